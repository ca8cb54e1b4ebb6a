"""Importing this package registers every scenario (harness.SCENARIOS)."""
from . import connect, errors, features, pubsub, retain, sessions, will  # noqa: F401
