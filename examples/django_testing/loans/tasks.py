"""The library's jobs: Celery tasks made durable (found by Celery's autodiscovery, no MOTIR_IMPORTS)."""

from loans.models import Loan
from motir_celery import define_job


@define_job("loans.send-receipt", retry_policy="transient")
def send_receipt(step, loan_id):
    loan = Loan.objects.select_related("book").get(pk=loan_id)   # committed with the run: always there
    text = step.run("render", lambda: f"{loan.reader} borrowed {loan.book.title}")
    Loan.objects.filter(pk=loan_id).update(receipt=text)
    return text


@define_job("loans.flag-overdue", bind=False)
def flag_overdue(days=21):
    """Run every morning by the beat_schedule entry (settings.py), under its Celery name."""
    return Loan.objects.filter(overdue=False, reader__startswith="late:").update(overdue=True)


@define_job("loans.count", bind=False)
def count_loans():
    return Loan.objects.count()
