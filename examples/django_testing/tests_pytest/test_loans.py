"""The same library under pytest-django, with no conftest: pytest.ini names the settings, that is all."""

import pytest
from django.db import connection
from library.celery import app
from loans.models import Book, Loan
from loans.tasks import count_loans

from motir_celery import current_engine


@pytest.mark.django_db
def test_the_engine_is_on_the_test_database():
    assert connection.settings_dict["NAME"].startswith("test_")
    assert current_engine().settings.require_database_url().split("?")[0].endswith("/" + connection.settings_dict["NAME"])


@pytest.mark.django_db
def test_eager_mode_in_a_db_test_runs_in_its_transaction(client):
    book = Book.objects.create(title="Ulysses")
    app.conf.task_always_eager = True
    try:
        handle = count_loans.delay()
        assert handle.get(timeout=1) == 0
        response = client.post("/borrow/", {"book": book.pk, "reader": "gus"})
    finally:
        app.conf.task_always_eager = False
    assert response.status_code == 201
    with connection.cursor() as cursor:   # the view's own atomic(): its run waits for a commit that never comes
        cursor.execute("SELECT state FROM job_queue WHERE id = %s", [response.json()["run"]])
        assert cursor.fetchone() == ("queued",)


def test_the_kit_runs_a_view_s_receipt(motir, client):
    book = Book.objects.create(title="Middlemarch")
    response = client.post("/borrow/", {"book": book.pk, "reader": "hal"})
    assert [job for _, job, _ in motir.published] == ["loans.send-receipt"]
    motir.drain()
    assert Loan.objects.get(pk=response.json()["loan"]).receipt == "hal borrowed Middlemarch"
