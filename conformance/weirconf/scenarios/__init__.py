"""Importing this package registers every scenario with harness.SCENARIOS."""
from . import routing, delivery, lifecycle, errors, deadletter  # noqa: F401
