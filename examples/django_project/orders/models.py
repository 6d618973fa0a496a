from django.db import models


class Order(models.Model):
    item = models.CharField(max_length=100)
    quantity = models.PositiveIntegerField(default=1)
    workspace = models.CharField(max_length=100)
    created_at = models.DateTimeField(auto_now_add=True)
    #: Set by the durable job orders.confirm (orders/tasks.py).
    confirmed_at = models.DateTimeField(null=True, blank=True)
