"""Queue types: which arguments a quorum queue refuses.

Weir emulates quorum queues on its one engine (x-queue-type: quorum is a
classic queue with a default delivery limit and delivery counting, and
must be durable); RabbitMQ 3.10 refuses classic-only arguments on them.
"""
from ..harness import scenario
from ..observe import expect_error


@scenario
def quorum_refuses_x_max_priority(ctx):
    """x-max-priority on a quorum queue is 406 in RabbitMQ 3.10 (quorum
    queues have no priorities there)."""
    conn = ctx.connect()
    out = expect_error(conn.channel().queue_declare, ctx.name("qq"), durable=True,
                       arguments={"x-queue-type": "quorum", "x-max-priority": 5})
    conn.close()
    return out
