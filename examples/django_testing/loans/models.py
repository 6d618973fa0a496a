from django.db import models


class Book(models.Model):
    title = models.CharField(max_length=200)
    copies = models.PositiveIntegerField(default=1)


class Loan(models.Model):
    book = models.ForeignKey(Book, on_delete=models.CASCADE, related_name="loans")
    reader = models.CharField(max_length=100)
    borrowed_at = models.DateTimeField(auto_now_add=True)
    #: Set by the durable job loans.tasks.send_receipt.
    receipt = models.CharField(max_length=300, blank=True)
    overdue = models.BooleanField(default=False)
