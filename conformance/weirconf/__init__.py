"""Weir AMQP 0-9-1 conformance harness: scenarios run through pika against a
reference broker (RabbitMQ) and a candidate (Weir); transcripts are compared."""
