// Weir's dashboard: polls the management API every POLL_MS and draws what it
// reads. No framework and no build step: the file is embedded in the binary
// as written. Field names are RabbitMQ's management API's, plus Weir's own
// (delayed messages, oldest-message age, delivery attempts).
'use strict';

const POLL_MS = 2000;
const HISTORY = 90; // points kept per chart (3 minutes at POLL_MS)
const AUTH_KEY = 'weir.auth';
const COLORS = ['#2f6fdb', '#16a34a', '#e08a00', '#b42318'];

const $ = (sel) => document.querySelector(sel);
const state = { admin: false, timer: null, selected: null, overview: [], queues: new Map(), rows: new Map() };

// ---------- API ----------

class ApiError extends Error {
  constructor(status, body) {
    super((body && (body.reason || body.error)) || `HTTP ${status}`);
    this.status = status;
  }
}

async function api(method, path) {
  const auth = sessionStorage.getItem(AUTH_KEY);
  // credentials: 'omit' keeps the browser's own Basic-auth prompt away on a
  // 401 (the fetch spec prompts only when credentials are included); the
  // Authorization header set here is sent all the same.
  const res = await fetch(path, {
    method, credentials: 'omit', headers: auth ? { Authorization: 'Basic ' + auth } : {},
  });
  if (res.status === 204) return null;
  const body = await res.json().catch(() => null);
  if (!res.ok) throw new ApiError(res.status, body);
  return body;
}

const enc = encodeURIComponent;
const queuePath = (q) => `/api/queues/${enc(q.vhost)}/${enc(q.name)}`;
// Paged answers ({items, ...}) and plain arrays both come back as arrays.
const items = (body) => (Array.isArray(body) ? body : (body && body.items) || []);

// ---------- formatting ----------

const num = (v) => (typeof v === 'number' && isFinite(v) ? v : 0);
const fmtInt = (v) => num(v).toLocaleString('en');
const fmtRate = (v) => { const n = num(v); return n >= 100 ? n.toFixed(0) : n.toFixed(1); };
function fmtAge(ms) {
  if (ms == null) return '–';
  const s = ms / 1000;
  if (s < 60) return s.toFixed(1) + ' s';
  if (s < 3600) return (s / 60).toFixed(1) + ' min';
  return (s / 3600).toFixed(1) + ' h';
}
const rate = (stats, key) => num(stats && stats[key + '_details'] && stats[key + '_details'].rate);

// Oldest-message age in ms: Weir's own field, else RabbitMQ's head timestamp (seconds).
function oldestAgeMs(q) {
  if (typeof q.oldest_message_age_ms === 'number') return q.oldest_message_age_ms;
  if (typeof q.oldest_message_age === 'number') return q.oldest_message_age * 1000;
  if (typeof q.head_message_timestamp === 'number') return Date.now() - q.head_message_timestamp * 1000;
  return null;
}
function maxAttempts(q) {
  const a = q.delivery_attempts;
  if (typeof a === 'number') return a;
  if (a && typeof a.max === 'number') return a.max;
  return num(q.max_delivery_attempts);
}
const delayed = (q) => num(q.messages_delayed);
// Mean enqueue-to-delivery wait over the last sample interval, ms (Weir's
// own field; null when nothing was delivered, drawn as 0).
const latencyMs = (o) => (o && typeof o.latency_ms === 'number' ? o.latency_ms : null);

function push(arr, v) { arr.push(v); if (arr.length > HISTORY) arr.shift(); }

// ---------- charts: lines on a canvas, drawn by hand ----------

function drawChart(canvas, series) {
  const ctx = canvas.getContext('2d');
  const w = canvas.width, h = canvas.height, padL = 44, padB = 14, padT = 8;
  ctx.clearRect(0, 0, w, h);
  const max = Math.max(1, ...series.flatMap((s) => s.values));
  // The x axis spans the points so far (at least 20), up to HISTORY.
  const span = Math.max(20, ...series.map((s) => s.values.length)) - 1;
  ctx.strokeStyle = '#e3e6ea'; ctx.fillStyle = '#667'; ctx.font = '11px system-ui';
  for (let i = 0; i <= 2; i++) {
    const y = padT + (h - padT - padB) * (i / 2);
    ctx.beginPath(); ctx.moveTo(padL, y); ctx.lineTo(w, y); ctx.stroke();
    ctx.fillText(fmtRate(max * (1 - i / 2)), 2, y + 4);
  }
  series.forEach((s, i) => {
    ctx.strokeStyle = s.color || COLORS[i % COLORS.length]; ctx.lineWidth = 1.5;
    ctx.beginPath();
    s.values.forEach((v, j) => {
      const x = padL + ((w - padL) * j) / span;
      const y = h - padB - ((h - padT - padB) * v) / max;
      j ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
    });
    ctx.stroke();
    ctx.fillStyle = ctx.strokeStyle;
    ctx.fillText(s.label, padL + 6 + i * 90, h - 2);
  });
}

// ---------- rendering ----------

function renderOverview(o) {
  const ot = o.object_totals || {}, qt = o.queue_totals || {}, ms = o.message_stats || {};
  $('#version').textContent = `${o.product_name || 'Weir'} ${o.product_version || ''}`;
  const totals = [
    ['Messages', qt.messages], ['Ready', qt.messages_ready], ['Unacked', qt.messages_unacknowledged],
    ['Publish /s', fmtRate(rate(ms, 'publish'))], ['Deliver /s', fmtRate(rate(ms, 'deliver_get'))],
    ['Connections', ot.connections], ['Channels', ot.channels], ['Queues', ot.queues], ['Consumers', ot.consumers],
  ];
  const box = $('#totals');
  box.replaceChildren(...totals.map(([label, v]) => {
    const d = document.createElement('div');
    d.dataset.total = label.toLowerCase();
    d.innerHTML = '<span class="muted"></span><b></b>';
    d.children[0].textContent = label;
    d.children[1].textContent = typeof v === 'string' ? v : fmtInt(v);
    return d;
  }));
  const h = state.overview;
  push(h, { pub: rate(ms, 'publish'), del: rate(ms, 'deliver_get'), ack: rate(ms, 'ack'),
            ready: num(qt.messages_ready), unacked: num(qt.messages_unacknowledged), latency: latencyMs(o) });
  drawChart($('#chart-rates'), [
    { label: 'publish', values: h.map((p) => p.pub) },
    { label: 'deliver', values: h.map((p) => p.del) },
    { label: 'ack', values: h.map((p) => p.ack) },
  ]);
  drawChart($('#chart-depth'), [
    { label: 'ready', values: h.map((p) => p.ready) },
    { label: 'unacked', values: h.map((p) => p.unacked) },
  ]);
  drawChart($('#chart-latency'), [{ label: 'latency ms', values: h.map((p) => num(p.latency)) }]);
}

function cell(tr, text, cls) {
  const td = tr.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
  return td;
}

function actionButton(label, action, q) {
  const b = document.createElement('button');
  b.textContent = label;
  b.dataset.action = action;
  b.addEventListener('click', (ev) => { ev.stopPropagation(); runAction(action, q); });
  return b;
}

// Rows are kept per queue and updated in place (not rebuilt each poll), so a
// click that lands while the page refreshes still reaches its button.
const QUEUE_COLS = ['vhost', 'name', 'depth', 'ready', 'unacked', 'delayed', 'consumers', 'in', 'out',
                    'oldest', 'attempts', 'trend', 'admin'];

function queueRow(q, key) {
  const tr = document.createElement('tr');
  tr.dataset.vhost = q.vhost;
  tr.dataset.name = q.name;
  const cells = {};
  for (const c of QUEUE_COLS) cells[c] = cell(tr, '', c);
  cells.spark = document.createElement('canvas');
  cells.spark.width = 90; cells.spark.height = 22;
  cells.trend.append(cells.spark);
  cells.admin.append(actionButton('Purge', 'purge', q), actionButton('Requeue DLQ', 'requeue', q),
                     actionButton('Delete', 'delete', q));
  tr.addEventListener('click', () => {
    state.selected = key;
    state.selectedLabel = `Queue ${q.name} (vhost ${q.vhost})`;
    renderDetail();
  });
  return { tr, cells };
}

function renderQueues(list) {
  const seen = new Set();
  const body = $('#queues tbody');
  for (const q of list) {
    const key = `${q.vhost}/${q.name}`;
    seen.add(key);
    let row = state.rows.get(key);
    if (!row) state.rows.set(key, (row = queueRow(q, key)));
    let h = state.queues.get(key);
    if (!h) state.queues.set(key, (h = []));
    const ms = q.message_stats || {};
    push(h, { ready: num(q.messages_ready), unacked: num(q.messages_unacknowledged), delayed: delayed(q),
              pub: rate(ms, 'publish'), del: rate(ms, 'deliver_get'), ack: rate(ms, 'ack'),
              latency: latencyMs(q), age: num(oldestAgeMs(q)) / 1000, attempts: maxAttempts(q) });
    const c = row.cells;
    c.vhost.textContent = q.vhost;
    c.name.textContent = q.name;
    c.depth.textContent = fmtInt(q.messages);
    c.depth.dataset.depth = String(num(q.messages));
    c.ready.textContent = fmtInt(q.messages_ready);
    c.unacked.textContent = fmtInt(q.messages_unacknowledged);
    c.delayed.textContent = fmtInt(delayed(q));
    c.consumers.textContent = fmtInt(q.consumers);
    c.in.textContent = fmtRate(rate(ms, 'publish'));
    c.out.textContent = fmtRate(rate(ms, 'deliver_get'));
    c.oldest.textContent = fmtAge(oldestAgeMs(q));
    c.attempts.textContent = fmtInt(maxAttempts(q));
    sparkline(c.spark, h.map((p) => p.ready + p.unacked + p.delayed));
    row.tr.classList.toggle('selected', state.selected === key);
    body.append(row.tr); // moves it into list order
  }
  for (const [k, row] of state.rows) {
    if (!seen.has(k)) { row.tr.remove(); state.rows.delete(k); state.queues.delete(k); }
  }
  state.lastQueues = list;
  renderDetail();
}

function sparkline(canvas, values) {
  const ctx = canvas.getContext('2d'), max = Math.max(1, ...values);
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.strokeStyle = COLORS[0];
  ctx.beginPath();
  values.forEach((v, i) => {
    const x = (canvas.width * i) / (Math.max(20, values.length) - 1), y = canvas.height - 1 - ((canvas.height - 2) * v) / max;
    i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
  });
  ctx.stroke();
}

function renderDetail() {
  const key = state.selected, h = key && state.queues.get(key);
  $('#queue-detail').hidden = !h;
  if (!h) return;
  $('#detail-title').textContent = state.selectedLabel;
  drawChart($('#detail-rates'), [
    { label: 'publish', values: h.map((p) => p.pub) },
    { label: 'deliver', values: h.map((p) => p.del) },
    { label: 'ack', values: h.map((p) => p.ack) },
  ]);
  drawChart($('#detail-depth'), [
    { label: 'ready', values: h.map((p) => p.ready) },
    { label: 'unacked', values: h.map((p) => p.unacked) },
    { label: 'delayed', values: h.map((p) => p.delayed) },
  ]);
  drawChart($('#detail-latency'), [{ label: 'latency ms', values: h.map((p) => num(p.latency)) }]);
  drawChart($('#detail-age'), [{ label: 'oldest age s', values: h.map((p) => p.age) }]);
  drawChart($('#detail-attempts'), [{ label: 'max attempts', values: h.map((p) => p.attempts) }]);
  // The ready messages by delivery attempts: buckets [{le, count}].
  const q = (state.lastQueues || []).find((x) => `${x.vhost}/${x.name}` === key);
  const hist = q && q.delivery_attempts && q.delivery_attempts.histogram;
  const t = $('#attempts');
  t.replaceChildren();
  if (Array.isArray(hist)) {
    const head = t.insertRow(), row = t.insertRow();
    cell(head, 'Attempts ≤'); cell(row, 'Ready messages');
    for (const b of hist) { cell(head, String(b.le)); cell(row, fmtInt(b.count)); }
  }
}

function renderConnections(list) {
  $('#conn-count').textContent = `(${list.length})`;
  $('#connections tbody').replaceChildren(...list.map((c) => {
    const tr = document.createElement('tr');
    tr.dataset.connection = c.name;
    [c.name, c.user, c.vhost, c.protocol, fmtInt(c.channels), c.state || 'running',
     fmtRate(rate(c, 'recv_oct')), fmtRate(rate(c, 'send_oct'))].forEach((v) => cell(tr, v ?? ''));
    return tr;
  }));
}

// ---------- actions ----------

const ACTIONS = {
  purge: { ask: 'Purge all messages from', method: 'DELETE', path: (q) => queuePath(q) + '/contents' },
  requeue: { ask: 'Move the dead letters back into', method: 'POST', path: (q) => queuePath(q) + '/requeue-dead-letters' },
  delete: { ask: 'Delete', method: 'DELETE', path: (q) => queuePath(q) },
};

async function runAction(action, q) {
  const a = ACTIONS[action];
  if (!window.confirm(`${a.ask} queue "${q.name}" (vhost ${q.vhost})?`)) return;
  try {
    const r = await api(a.method, a.path(q));
    // requeue-dead-letters answers how many moved back and how many stayed.
    $('#status').textContent = r && typeof r.moved === 'number' ? `${q.name}: ${r.moved} moved back, ${r.kept} kept` : '';
  } catch (e) {
    $('#status').textContent = `${action} ${q.name}: ${e.message}`;
  }
  refresh();
}

// ---------- polling and login ----------

async function refresh() {
  try {
    const filter = $('#filter').value.trim();
    const qs = `page=1&page_size=100&sort=name${filter ? '&name=' + enc(filter) : ''}`;
    const [o, qs_, cs] = await Promise.all([
      api('GET', '/api/overview'), api('GET', '/api/queues?' + qs), api('GET', '/api/connections'),
    ]);
    renderOverview(o);
    const list = items(qs_);
    const total = qs_ && typeof qs_.total_count === 'number' ? qs_.total_count : list.length;
    $('#queue-count').textContent = list.length < total ? `(${list.length} of ${fmtInt(total)})` : `(${list.length})`;
    renderQueues(list);
    renderConnections(items(cs));
    $('#status').textContent = '';
  } catch (e) {
    if (e.status === 401) return logout('Session expired: log in again.');
    $('#status').textContent = `Cannot reach the API: ${e.message}`;
  }
}

function showApp(who) {
  const tags = Array.isArray(who.tags) ? who.tags : String(who.tags || '').split(',');
  state.admin = tags.map((t) => t.trim()).includes('administrator');
  document.body.classList.toggle('is-admin', state.admin);
  $('#who').textContent = `${who.name}${tags.length ? ' (' + tags.join(', ') + ')' : ''}`;
  $('#login').hidden = true; $('#app').hidden = false; $('#logout').hidden = false;
  refresh();
  state.timer = setInterval(refresh, POLL_MS);
}

function logout(message) {
  sessionStorage.removeItem(AUTH_KEY);
  clearInterval(state.timer);
  $('#app').hidden = true; $('#logout').hidden = true; $('#login').hidden = false;
  $('#who').textContent = '';
  $('#login-error').textContent = message || '';
}

$('#login').addEventListener('submit', async (ev) => {
  ev.preventDefault();
  const f = ev.target;
  // btoa takes Latin-1 only: encode the UTF-8 bytes first.
  const raw = new TextEncoder().encode(`${f.user.value}:${f.password.value}`);
  sessionStorage.setItem(AUTH_KEY, btoa(String.fromCharCode(...raw)));
  try {
    showApp(await api('GET', '/api/whoami'));
  } catch (e) {
    logout(e.status === 401 ? 'Wrong user or password.' : `Login failed: ${e.message}`);
  }
});
$('#logout').addEventListener('click', () => logout());
$('#filter').addEventListener('change', refresh);

(async () => {
  if (!sessionStorage.getItem(AUTH_KEY)) return logout();
  try { showApp(await api('GET', '/api/whoami')); } catch (e) { logout(); }
})();
