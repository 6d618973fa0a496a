"""What the engine's in-process tests share: the test kit with the side-effect ledger."""

from __future__ import annotations

import pytest

from motir_celery.testing import Motir
from tests.fixtures.kit_workers import effects


@pytest.fixture
def kit(motir: Motir) -> Motir:
    """The test kit (``motir``), with the side-effect ledger of tests/fixtures/jobs.py
    (``test.side_effect``, where jobs record each execution) in its database, empty."""
    effects(motir)
    return motir
