"""Importing this package registers every scenario with harness.SCENARIOS."""
from . import routing, delivery, lifecycle, errors, consumers, tx, deadletter, policies, beyond, redeclare, dlx_properties, queue_types, idempotency, compat  # noqa: F401
