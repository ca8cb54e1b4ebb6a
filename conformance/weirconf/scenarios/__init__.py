"""Importing this package registers every scenario with harness.SCENARIOS."""
from . import routing, delivery, lifecycle, errors, consumers, tx, deadletter, idempotency  # noqa: F401
