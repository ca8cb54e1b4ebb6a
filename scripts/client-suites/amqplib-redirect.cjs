// Preloaded (node --require) into amqplib's own test run by
// scripts/client-suites.sh: some of its tests connect to the hard-coded
// default `amqp://localhost` (port 5672) instead of the URL the suite is
// given. Send those connections to the broker under test
// (CLIENT_SUITES_AMQP_PORT on 127.0.0.1), so that each run measures one
// broker only; every other connection is left alone.
'use strict';
const net = require('node:net');

const target = Number(process.env.CLIENT_SUITES_AMQP_PORT);
if (!Number.isInteger(target) || target <= 0) {
  throw new Error('CLIENT_SUITES_AMQP_PORT must name the port of the broker under test');
}
const LOCAL = new Set([undefined, 'localhost', '127.0.0.1', '::1']);
const original = net.connect;

net.connect = net.createConnection = function connect(...args) {
  const opts = args[0];
  if (opts && typeof opts === 'object' && Number(opts.port) === 5672 && LOCAL.has(opts.host)) {
    args[0] = { ...opts, host: '127.0.0.1', port: target };
  }
  return original.apply(this, args);
};
