# Create your tasks here

from demoapp.models import Widget
from motir_celery import RetryPolicy, define_job


@define_job("demoapp.add", bind=False)
def add(x, y):
    return x + y


@define_job("demoapp.mul", bind=False)
def mul(x, y):
    return x * y


@define_job("demoapp.xsum", bind=False)
def xsum(numbers):
    return sum(numbers)


@define_job("demoapp.count-widgets", bind=False)
def count_widgets():
    return Widget.objects.count()


@define_job("demoapp.rename-widget", bind=False)
def rename_widget(widget_id, name):
    w = Widget.objects.get(id=widget_id)
    w.name = name
    w.save()


@define_job("demoapp.error-task", retry_policy=RetryPolicy(max_attempts=3, backoff=600, factor=1, jitter=0))
def error_task(self):
    raise Exception("Test error")


@define_job("demoapp.error-backoff-test", retry_policy=RetryPolicy(max_attempts=4, backoff=5, factor=2, jitter=0))
def error_backoff_test(self):
    raise Exception("Test error")
