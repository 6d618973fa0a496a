"""The library's tests, for Django's own runner (``python manage.py test``): TestCase and TransactionTestCase,
jobs run eagerly (Celery's ``task_always_eager``) and through motir-celery's test kit.

Nothing here configures motir for the tests: the engine follows Django's test database (created,
migrated, flushed and dropped with it), and a TestCase's runs are written — and run, when eager —
in the test's own transaction, so its rollback takes them.
"""

from contextlib import contextmanager

import psycopg
from django.db import connection
from django.test import TestCase, TransactionTestCase
from library.celery import app

from loans.models import Book, Loan
from loans.tasks import count_loans, send_receipt
from motir_celery import current_engine
from motir_celery.core.jobs import job_for_task
from motir_celery.testing import Motir

#: The runs the TestCase tests wrote: the first TransactionTestCase checks none of them survived.
WRITTEN_IN_TEST_CASES: list[str] = []


@contextmanager
def eager():
    app.conf.task_always_eager = True     # CELERY_TASK_ALWAYS_EAGER = True in a test settings module
    try:
        yield
    finally:
        app.conf.task_always_eager = False


def runs_seen_from_another_connection(run_ids):
    """The runs another session sees (committed ones only): a fresh psycopg connection to the database."""
    url = current_engine().settings.require_database_url().replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(url) as other:
        return [r[0] for r in other.execute("SELECT id::text FROM job_queue WHERE id::text = ANY(%s)",
                                            [list(run_ids)])]


class BorrowingTests(TestCase):
    @classmethod
    def setUpTestData(cls):
        cls.book = Book.objects.create(title="Dune", copies=2)

    def test_the_engine_is_on_the_test_database(self):
        url = current_engine().settings.require_database_url()
        self.assertTrue(url.split("?")[0].endswith("/" + connection.settings_dict["NAME"]), url)
        self.assertTrue(connection.settings_dict["NAME"].startswith("test_"))

    def test_a_borrowing_runs_its_receipt_eagerly_inside_the_tests_transaction(self):
        with eager(), self.captureOnCommitCallbacks(execute=True):
            response = self.client.post("/borrow/", {"book": self.book.pk, "reader": "ada"})
        self.assertEqual(response.status_code, 201)
        loan = Loan.objects.get(pk=response.json()["loan"])
        self.assertEqual(loan.receipt, "ada borrowed Dune")
        run = response.json()["run"]
        WRITTEN_IN_TEST_CASES.append(run)
        with connection.cursor() as cursor:   # on the test's connection: the run, succeeded
            cursor.execute("SELECT state FROM job_queue WHERE id = %s", [run])
            self.assertEqual(cursor.fetchone(), ("succeeded",))
        self.assertEqual(runs_seen_from_another_connection([run]), [])   # never committed

    def test_a_task_called_outside_an_atomic_block_runs_at_once_and_answers(self):
        Loan.objects.create(book=self.book, reader="bob")
        with eager():
            handle = count_loans.delay()
        WRITTEN_IN_TEST_CASES.append(str(handle.id))
        self.assertEqual(handle.get(timeout=1), 1)
        self.assertEqual(send_receipt(Loan.objects.get().pk), "bob borrowed Dune")  # a direct call: the body

    def test_a_run_sent_without_eager_mode_is_written_in_the_test_and_rolled_back_with_it(self):
        loan = Loan.objects.create(book=self.book, reader="cy")
        handle = send_receipt.delay(loan.pk)
        WRITTEN_IN_TEST_CASES.append(str(handle.id))
        with connection.cursor() as cursor:
            cursor.execute("SELECT state FROM job_queue WHERE id = %s", [str(handle.id)])
            self.assertEqual(cursor.fetchone(), ("queued",))

    def test_the_beat_schedule_names_a_durable_job(self):
        entry = app.conf.beat_schedule["overdue-every-morning"]
        self.assertEqual(job_for_task(entry["task"]).id, "loans.flag-overdue")


class AAfterTheTestCases(TransactionTestCase):
    """Django runs every TestCase before any TransactionTestCase: this one runs first of those."""

    def test_nothing_the_test_cases_wrote_is_left(self):
        self.assertEqual(len(WRITTEN_IN_TEST_CASES), 3)
        self.assertEqual(runs_seen_from_another_connection(WRITTEN_IN_TEST_CASES), [])


class CommittedBorrowingTests(TransactionTestCase):
    def setUp(self):
        self.book = Book.objects.create(title="Emma", copies=1)

    def test_an_eager_receipt_runs_when_the_view_commits(self):
        with eager():
            response = self.client.post("/borrow/", {"book": self.book.pk, "reader": "dee"})
        self.assertEqual(Loan.objects.get(pk=response.json()["loan"]).receipt, "dee borrowed Emma")
        self.assertEqual(runs_seen_from_another_connection([response.json()["run"]]), [response.json()["run"]])

    def test_the_kit_drains_the_run_a_view_committed(self):
        kit = Motir(settings=current_engine().settings)
        kit.install()
        try:
            response = self.client.post("/borrow/", {"book": self.book.pk, "reader": "eve"})
            self.assertEqual([job for _, job, _ in kit.published], ["loans.send-receipt"])
            self.assertEqual(Loan.objects.get().receipt, "")
            kit.drain()
        finally:
            kit.uninstall()
        self.assertEqual(Loan.objects.get(pk=response.json()["loan"]).receipt, "eve borrowed Emma")

    def test_a_refused_borrowing_leaves_no_run(self):
        Book.objects.filter(pk=self.book.pk).update(copies=0)
        response = self.client.post("/borrow/", {"book": self.book.pk, "reader": "fay"})
        self.assertEqual(response.status_code, 409)
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM job_queue")
            self.assertEqual(cursor.fetchone(), (0,))   # emptied after each TransactionTestCase, like Django's tables
