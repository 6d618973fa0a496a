from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from loans.models import Book, Loan
from loans.tasks import send_receipt


@csrf_exempt
@require_POST
def borrow(request: HttpRequest) -> JsonResponse:
    with transaction.atomic():
        book = Book.objects.select_for_update().get(pk=request.POST["book"])
        if book.copies == 0:
            return JsonResponse({"error": "no copy left"}, status=409)
        book.copies -= 1
        book.save(update_fields=["copies"])
        loan = Loan.objects.create(book=book, reader=request.POST["reader"])
        handle = send_receipt.delay_on_commit(loan.pk)   # Celery's Django helper, unchanged
    return JsonResponse({"loan": loan.pk, "run": str(handle.id)}, status=201)


def show(request: HttpRequest, loan_id: int) -> JsonResponse:
    loan = Loan.objects.get(pk=loan_id)
    return JsonResponse({"loan": loan.pk, "receipt": loan.receipt, "overdue": loan.overdue})
