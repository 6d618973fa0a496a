"""A producer with no motir-celery in it: a plain ``Celery(broker=...)`` app sending by task name.

``python plain_producer.py NAME ARGS [ARGS ...] [--duplicate] [--protocol-1]`` sends one message
per ARGS (a JSON array) to task NAME and prints one JSON line: the task ids, and whether any
motir module was loaded. ``celery -A plain_producer call ...`` uses the same app.
"""

import json
import os
import sys

from celery import Celery

app = Celery("producer", broker=os.environ["CELERY_BROKER_URL"], set_as_current=True)
app.conf.update(task_default_queue=os.environ["SHOP_QUEUE"])

if __name__ == "__main__":
    flags = {a for a in sys.argv[1:] if a.startswith("--")}
    name, *calls = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--protocol-1" in flags:
        app.conf.task_protocol = 1
    ids = [app.send_task(name, json.loads(args)).id for args in calls]
    if "--duplicate" in flags:  # the last message twice: same task id, same arguments
        app.send_task(name, json.loads(calls[-1]), task_id=ids[-1])
    print(json.dumps({"ids": ids, "motir_loaded": any(m.startswith("motir_celery") for m in sys.modules)}))
