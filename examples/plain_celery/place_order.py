"""The web/shell side: place an order and wait for its fulfilment.

    python -m examples.plain_celery.place_order 42

Importing the app module first makes ``delay()`` publish through the project's
Celery app (``attach``). ``.get()`` reads the result from Postgres: no Celery
result backend is configured.
"""

from __future__ import annotations

import json
import sys

from examples.plain_celery.app import app  # noqa: F401  (attach: publish through the project's app)
from examples.plain_celery.tasks import fulfil_order, send_newsletter


def main(argv: list[str]) -> int:
    order_id = int(argv[0]) if argv else 42
    handle = fulfil_order.delay(order_id)
    again = fulfil_order.apply_async(args=[order_id], task_id=f"order-{order_id}")
    same = fulfil_order.apply_async(args=[order_id], task_id=f"order-{order_id}")  # a retried request
    send_newsletter.delay(7)  # the plain Celery task, on the same app and worker
    print(json.dumps({
        "result": handle.get(timeout=60),
        "state": handle.state,
        "keyed": {"first": str(again.id), "second": str(same.id), "deduplicated": same.deduplicated},
        "keyed_result": again.get(timeout=60),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
