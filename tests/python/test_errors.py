"""Channel and connection errors with the reply codes RabbitMQ clients expect."""
import urllib.parse

import pika
import pika.exceptions as px
import pytest

from amqp_helpers import channel_error


def test_passive_declare_missing_queue_and_exchange_404(conn, names):
    assert channel_error(conn.channel().queue_declare, names("missing"), passive=True) == 404
    assert channel_error(conn.channel().exchange_declare, names("missing-x"), passive=True) == 404
    assert conn.is_open


def test_redeclare_with_different_properties_406(conn, names):
    q, x = names("q"), names("x")
    conn.channel().queue_declare(q, durable=True, arguments={"x-max-length": 10})
    conn.channel().queue_declare(q, durable=True, arguments={"x-max-length": 10})  # equivalent: fine
    assert channel_error(conn.channel().queue_declare, q, durable=False, arguments={"x-max-length": 10}) == 406
    assert channel_error(conn.channel().queue_declare, q, durable=True, arguments={"x-max-length": 20}) == 406
    conn.channel().exchange_declare(x, "direct")
    assert channel_error(conn.channel().exchange_declare, x, "fanout") == 406
    assert channel_error(conn.channel().exchange_declare, x, "direct", durable=True) == 406


def test_publish_to_missing_exchange_closes_channel_404(conn, names):
    ch = conn.channel()
    ch.basic_publish(names("missing"), "rk", b"x")
    # No reply to basic.publish: the channel.close shows up on the next RPC.
    assert channel_error(ch.queue_declare, "", exclusive=True) == 404
    cch = conn.channel()
    cch.confirm_delivery()
    assert channel_error(cch.basic_publish, names("missing2"), "rk", b"x") == 404
    assert conn.is_open


def test_exclusive_queue_from_other_connection_405(connect, conn, names):
    q = names("q")
    conn.channel().queue_declare(q, exclusive=True)
    other = connect()
    assert channel_error(other.channel().queue_declare, q, exclusive=True) == 405
    assert channel_error(other.channel().queue_declare, q, passive=True) == 405
    assert channel_error(other.channel().basic_consume, q, lambda *a: None) == 405
    assert channel_error(other.channel().basic_get, q) == 405


def test_exclusive_queue_deleted_with_owner(connect, names):
    owner, observer = connect(), connect()
    q = names("q")
    owner.channel().queue_declare(q, exclusive=True)
    owner.close()
    from amqp_helpers import queue_exists, wait_until
    assert wait_until(lambda: not queue_exists(observer, q))


def test_reserved_amq_exchange_names_403(conn, names):
    assert channel_error(conn.channel().exchange_declare, "amq." + names("custom"), "direct") == 403
    assert channel_error(conn.channel().exchange_delete, "amq.direct") == 403
    conn.channel().exchange_declare("amq.direct", "direct", passive=True)
    conn.channel().exchange_declare("amq.topic", "topic", passive=True)
    conn.channel().exchange_declare("amq.fanout", "fanout", passive=True)
    conn.channel().exchange_declare("amq.headers", "headers", passive=True)


def _url(base, user=None, password=None, vhost=None):
    p = urllib.parse.urlsplit(base)
    netloc = f"{user or p.username}:{password or p.password}@{p.hostname}:{p.port}"
    path = p.path if vhost is None else "/" + urllib.parse.quote(vhost, safe="")
    return urllib.parse.urlunsplit((p.scheme, netloc, path, "", ""))


@pytest.mark.parametrize("user,password", [("guest", "wrong-password"), ("no-such-user", "x")])
def test_wrong_credentials_refused_403(amqp_url, user, password):
    with pytest.raises(px.ProbableAuthenticationError) as ei:
        pika.BlockingConnection(pika.URLParameters(_url(amqp_url, user, password)))
    assert "403" in str(ei.value) and "ACCESS_REFUSED" in str(ei.value)


def test_wrong_vhost_not_allowed_530(amqp_url):
    with pytest.raises(px.ProbableAccessDeniedError) as ei:
        pika.BlockingConnection(pika.URLParameters(_url(amqp_url, vhost="no-such-vhost")))
    assert "530" in str(ei.value) and "NOT_ALLOWED" in str(ei.value)
