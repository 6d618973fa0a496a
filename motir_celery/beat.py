"""The public path of the beat scheduler, as users write it in their configs:
``beat_scheduler = "motir_celery.beat:MotirScheduler"`` (or ``MotirCronMixin``
for a scheduler of their own). The code lives in ``adapter/beat.py``."""

from motir_celery.adapter.beat import MotirCronMixin, MotirScheduler

__all__ = ["MotirCronMixin", "MotirScheduler"]
