"""Fixtures of the chaos scenarios: the session's migrated database and a log folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.scenarios import Base


@pytest.fixture
def chaos(database_url: str, tmp_path: Path) -> Base:
    """Each scenario truncates the engine's tables and the ledger itself, and starts its own broker."""
    return Base(database_url, tmp_path)
