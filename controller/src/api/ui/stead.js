// stead's status page script: polls the JSON API every 2 s (one request in flight at
// most) and updates the page in place, follows the logs a reader opens, asks for the
// API token when the agent has one (kept in this tab's session storage only), and
// sends the actions (restart, signal) after a confirmation. Text from the agent is only
// ever set as text, never as HTML.
'use strict';
(() => {
  const POLL_MS = 2000;
  const EVENTS_SHOWN = 50;
  const LOG_KEEP_CHARS = 256 * 1024;
  const TOKEN_KEY = 'stead-token';

  let skew = 0; // the agent's clock minus the browser's, in ms
  let timer = null;
  let inFlight = false;
  const follows = new Map(); // details element -> AbortController

  const token = () => sessionStorage.getItem(TOKEN_KEY);
  const view = () => document.body.dataset.view;
  const allocName = () => document.body.dataset.alloc;
  const enc = encodeURIComponent;

  function headers(extra) {
    const all = Object.assign({}, extra);
    const t = token();
    if (t) all.Authorization = 'Bearer ' + t;
    return all;
  }

  function notice(text, bad) {
    const box = document.getElementById('notice');
    box.textContent = text;
    box.className = bad ? 'bad' : '';
  }

  async function request(path, options) {
    const response = await fetch(path, Object.assign({ cache: 'no-store', headers: headers() }, options));
    const date = Date.parse(response.headers.get('Date'));
    if (!Number.isNaN(date)) skew = date - Date.now();
    return response;
  }

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function duration(ms) {
    const s = Math.floor(ms / 1000);
    if (s < 60) return s + 's';
    if (s < 3600) return Math.floor(s / 60) + 'm ' + (s % 60) + 's';
    if (s < 86400) return Math.floor(s / 3600) + 'h ' + (Math.floor(s / 60) % 60) + 'm';
    return Math.floor(s / 86400) + 'd ' + (Math.floor(s / 3600) % 24) + 'h';
  }

  function bytes(n) {
    const k = 1024;
    if (n < k * k) return (n / k).toFixed(1) + ' KiB';
    if (n < k * k * k) return (n / k / k).toFixed(1) + ' MiB';
    return (n / k / k / k).toFixed(1) + ' GiB';
  }

  function timeEl(at) {
    const node = el('time');
    node.setAttribute('datetime', at);
    return node;
  }

  // Every time on the page, aged on the agent's clock.
  function ages() {
    const now = Date.now() + skew;
    for (const node of document.querySelectorAll('time[datetime]')) {
      const at = Date.parse(node.getAttribute('datetime'));
      if (!Number.isNaN(at)) node.textContent = duration(Math.max(0, now - at)) + ' ago';
    }
  }

  function setText(node, text) {
    if (node && node.textContent !== text) node.textContent = text;
  }

  function statusEl(status) {
    return el('span', 'status s-' + status, status);
  }

  // Loads this address again with the token and puts it in place of the page; false
  // when the agent refuses the token.
  async function reload() {
    const response = await request(location.pathname + location.search, { headers: headers({ Accept: 'text/html' }) });
    if (response.status === 401) return false;
    const doc = new DOMParser().parseFromString(await response.text(), 'text/html');
    const filter = document.getElementById('filter');
    const typed = filter ? filter.value : null;
    stopFollows();
    document.title = doc.title;
    document.body.dataset.view = doc.body.dataset.view;
    if (doc.body.dataset.alloc) document.body.dataset.alloc = doc.body.dataset.alloc;
    else delete document.body.dataset.alloc;
    document.querySelector('header.top .node').textContent = doc.querySelector('header.top .node').textContent;
    document.getElementById('main').replaceWith(document.adoptNode(doc.getElementById('main')));
    const again = document.getElementById('filter');
    if (again && typed !== null) again.value = typed;
    start();
    return true;
  }

  function refused() {
    notice('The agent refused the token: forget it and enter the current one.', true);
  }

  function rank(item) {
    if (item.clientStatus === 'failed') return 0;
    if (item.specError) return 1;
    if (item.clientStatus === 'pending') return 2;
    if (item.clientStatus === 'running') return 3;
    return 4;
  }

  function applyFilter() {
    const filter = document.getElementById('filter');
    if (!filter) return;
    const wanted = filter.value.trim();
    for (const row of document.querySelectorAll('#allocs tbody tr')) {
      row.hidden = !row.dataset.alloc.includes(wanted);
    }
  }

  async function pollNode() {
    const response = await request('/v1/allocs?usage=true');
    if (response.status === 401) return refused();
    if (!response.ok) throw new Error('HTTP ' + response.status);
    const items = await response.json();
    const body = document.querySelector('#allocs tbody');
    const rows = new Map(Array.from(body.rows, (row) => [row.dataset.alloc, row]));
    const q = new URLSearchParams(location.search).get('q') || '';
    const shown = items.filter((item) => item.name.includes(q.trim()));
    const changed = shown.length !== rows.size || shown.some((item) => {
      const row = rows.get(item.name);
      return !row || Boolean(row.querySelector('[data-f="spec-error"]')) !== item.specError;
    });
    if (changed) return reload();
    const counts = {};
    for (const item of items) counts[item.clientStatus] = (counts[item.clientStatus] || 0) + 1;
    for (const node of document.querySelectorAll('[data-count]')) setText(node, String(counts[node.dataset.count] || 0));
    for (const item of shown) {
      const row = rows.get(item.name);
      const cell = (f) => row.querySelector('[data-f="' + f + '"]');
      const status = cell('status');
      if (status.textContent !== item.clientStatus) {
        status.textContent = item.clientStatus;
        status.className = 'status s-' + item.clientStatus;
      }
      setText(cell('tasks'), item.runningTasks + '/' + item.tasks);
      setText(cell('restarts'), String(item.restarts));
      const event = cell('event');
      const last = item.lastEvent;
      const shownAt = event.querySelector('time');
      const title = last ? last.task + ': ' + last.type : '';
      if (!last) event.replaceChildren();
      else if (!shownAt || shownAt.getAttribute('datetime') !== last.time || event.querySelector('b').textContent !== title) {
        event.replaceChildren(el('b', '', title), ' ' + last.message + ' ', timeEl(last.time));
      }
      const usage = item.usage || {};
      setText(cell('cpu'), usage.cpuPercent == null ? '' : usage.cpuPercent.toFixed(1) + '%');
      setText(cell('memory'), usage.memoryBytes == null ? '' : bytes(usage.memoryBytes));
      row.dataset.rank = String(rank(item));
    }
    const sorted = Array.from(body.rows).sort((a, b) =>
      Number(a.dataset.rank) - Number(b.dataset.rank) || (a.dataset.alloc < b.dataset.alloc ? -1 : 1));
    sorted.forEach((row, i) => { if (body.rows[i] !== row) body.insertBefore(row, body.rows[i]); });
    applyFilter();
  }

  function stateCell(td, task) {
    const text = task.state + (task.failed ? ' (failed)' : '');
    if (td.firstChild && td.firstChild.textContent === text && Boolean(td.querySelector('.badge')) === oomKilled(task)) return;
    td.replaceChildren(el('span', 'state t-' + task.state + (task.failed ? ' t-failed' : ''), text));
    if (oomKilled(task)) td.append(' ', el('span', 'badge b-error', 'OOM killed'));
  }

  function oomKilled(task) {
    return (task.oomKills || 0) > 0 || Boolean(task.lastExit && task.lastExit.oomKilled);
  }

  function timeCell(td, at) {
    const shown = td.querySelector('time');
    if (!at) td.replaceChildren();
    else if (!shown || shown.getAttribute('datetime') !== at) td.replaceChildren(timeEl(at));
  }

  async function pollAlloc() {
    const name = allocName();
    const response = await request('/v1/allocs/' + enc(name));
    if (response.status === 401) return refused();
    if (response.status === 404) return notice('Alloc ' + name + ' is gone from the node.', true);
    if (!response.ok) throw new Error('HTTP ' + response.status);
    const status = await response.json();
    const main = document.getElementById('main');
    const body = document.querySelector('#tasks tbody');
    const rows = new Map(Array.from(body.rows, (row) => [row.dataset.task, row]));
    const names = Object.keys(status.tasks);
    const specError = main.querySelector('pre[data-f="spec-error"]');
    if (names.length !== rows.size || names.some((n) => !rows.has(n)) ||
        main.dataset.revision !== status.revision ||
        (specError ? specError.textContent : null) !== (status.specError || null)) {
      return reload();
    }
    const heading = main.querySelector('h1 [data-f="status"]');
    if (heading.textContent !== status.clientStatus) heading.replaceChildren(statusEl(status.clientStatus));
    for (const [taskName, task] of Object.entries(status.tasks)) {
      const row = rows.get(taskName);
      const cell = (f) => row.querySelector('[data-f="' + f + '"]');
      stateCell(cell('state'), task);
      setText(cell('restarts'), String(task.restarts));
      const last = task.events[task.events.length - 1];
      const event = cell('event');
      const message = event.querySelector('.event-message');
      if (!last) event.replaceChildren();
      else if (!message || message.textContent !== last.message || event.querySelector('.event-type').textContent !== last.type) {
        event.replaceChildren(el('span', 'event-type', last.type), ' ', el('span', 'event-message', last.message));
      }
      timeCell(cell('started'), task.startedAt);
      timeCell(cell('finished'), task.finishedAt);
      setText(cell('pid'), task.pid == null ? '' : String(task.pid));
      const checks = cell('checks');
      const text = (task.checks || []).map((c) => c.name + ': ' + c.status).join(' ');
      if (checks.textContent.trim() !== text) {
        checks.replaceChildren();
        for (const check of task.checks || []) {
          const span = el('span', 'check c-' + check.status, check.name + ': ' + check.status);
          span.title = check.output;
          checks.append(span, ' ');
        }
      }
    }
    const events = [];
    for (const [taskName, task] of Object.entries(status.tasks)) {
      // Newest first; of a task's events at the same time, the later one first.
      for (const event of task.events.slice().reverse()) events.push([taskName, event]);
    }
    events.sort((a, b) => Date.parse(b[1].time) - Date.parse(a[1].time));
    const list = document.querySelector('#events tbody');
    const rowsNow = events.slice(0, EVENTS_SHOWN).map(([taskName, event]) => {
      const tr = el('tr');
      const when = el('td');
      when.append(timeEl(event.time));
      tr.append(when, el('td', '', taskName), el('td', '', event.type), el('td', '', event.message));
      return tr;
    });
    const key = (tr) => Array.from(tr.cells, (td) => td.querySelector('time') ? td.querySelector('time').getAttribute('datetime') : td.textContent).join('\u0000');
    const before = Array.from(list.rows, key).join('\u0001');
    if (before !== rowsNow.map(key).join('\u0001')) list.replaceChildren(...rowsNow);
  }

  async function poll() {
    if (inFlight) return;
    inFlight = true;
    try {
      if (view() === 'node') await pollNode();
      else if (view() === 'alloc') await pollAlloc();
    } catch (error) {
      notice('Cannot reach the agent: ' + error.message, true);
    } finally {
      inFlight = false;
      // How many polls ended, for whoever watches the page (its tests wait on it).
      document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
      ages();
      schedule(POLL_MS);
    }
  }

  function schedule(ms) {
    clearTimeout(timer);
    if (view() === 'node' || view() === 'alloc') timer = setTimeout(poll, ms);
  }

  // Logs: each open one is followed from where the page's tail ended.
  function append(pre, text) {
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    pre.append(text);
    if (pre.textContent.length > LOG_KEEP_CHARS) pre.textContent = pre.textContent.slice(-LOG_KEEP_CHARS / 2);
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  }

  async function follow(details) {
    if (follows.has(details)) return;
    const controller = new AbortController();
    follows.set(details, controller);
    const pre = details.querySelector('pre');
    const path = '/v1/allocs/' + enc(allocName()) + '/logs/' + enc(details.dataset.task) +
      '?type=' + enc(details.dataset.stream) + '&follow=true&offset=' + enc(details.dataset.offset);
    try {
      const response = await fetch(path, { headers: headers(), signal: controller.signal, cache: 'no-store' });
      if (!response.ok) {
        let message = response.statusText;
        try { message = (await response.json()).message; } catch (_) { /* not JSON */ }
        append(pre, '\n[not following: ' + message + ']\n');
        return;
      }
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        details.dataset.offset = String(Number(details.dataset.offset) + value.byteLength);
        append(pre, decoder.decode(value, { stream: true }));
      }
    } catch (error) {
      if (error.name !== 'AbortError') append(pre, '\n[following stopped: ' + error.message + ']\n');
    } finally {
      if (follows.get(details) === controller) follows.delete(details);
    }
  }

  function stopFollows() {
    for (const controller of follows.values()) controller.abort();
    follows.clear();
  }

  document.addEventListener('toggle', (event) => {
    const details = event.target;
    if (!(details instanceof HTMLDetailsElement) || !details.classList.contains('log')) return;
    if (details.open) follow(details);
    else {
      const controller = follows.get(details);
      if (controller) controller.abort();
      follows.delete(details);
    }
  }, true);

  // Actions, each behind the confirmation dialog.
  function confirmThen(text, then) {
    const dialog = document.getElementById('confirm');
    document.getElementById('confirm-text').textContent = text;
    dialog.returnValue = '';
    dialog.onclose = () => { if (dialog.returnValue === 'ok') then(); };
    dialog.showModal();
  }

  async function act(path, body, what) {
    try {
      const response = await request(path, {
        method: 'POST',
        headers: headers({ 'Content-Type': 'application/json' }),
        body: JSON.stringify(body),
      });
      if (response.ok) notice(what + ': accepted.');
      else {
        let message = response.statusText;
        try { message = (await response.json()).message; } catch (_) { /* not JSON */ }
        notice(what + ': refused (' + response.status + '): ' + message, true);
      }
    } catch (error) {
      notice(what + ': cannot reach the agent: ' + error.message, true);
    }
    schedule(250);
  }

  document.addEventListener('click', (event) => {
    const target = event.target instanceof Element ? event.target : null;
    if (target && target.id === 'forget') {
      sessionStorage.removeItem(TOKEN_KEY);
      location.reload();
      return;
    }
    const button = target && target.closest('button[data-action]');
    if (!button) return;
    const alloc = allocName();
    const task = button.dataset.task;
    const path = '/v1/allocs/' + enc(alloc) + '/' + button.dataset.action;
    if (button.dataset.action === 'restart') {
      const what = task ? 'Restart of task ' + task : 'Restart of alloc ' + alloc;
      const question = task ? 'Restart task ' + task + ' of alloc ' + alloc + '?' : 'Restart every running task of alloc ' + alloc + '?';
      confirmThen(question, () => act(path, task ? { task } : {}, what));
    } else if (button.dataset.action === 'signal') {
      const select = Array.from(document.querySelectorAll('select[data-signal-for]')).find((s) => s.dataset.signalFor === task);
      const signal = select ? select.value : 'SIGHUP';
      confirmThen('Send ' + signal + ' to task ' + task + ' of alloc ' + alloc + '?',
        () => act(path, { task, signal }, signal + ' to task ' + task));
    }
  });

  document.addEventListener('input', (event) => {
    if (event.target instanceof Element && event.target.id === 'filter') applyFilter();
  });

  document.addEventListener('submit', async (event) => {
    if (!(event.target instanceof Element) || event.target.id !== 'login') return;
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, document.getElementById('token').value.trim());
    if (!(await reload())) {
      sessionStorage.removeItem(TOKEN_KEY);
      notice('The agent refused that token.', true);
    }
  });

  function start() {
    document.getElementById('forget').hidden = !token();
    for (const details of document.querySelectorAll('details.log[open]')) follow(details);
    applyFilter();
    ages();
    schedule(POLL_MS);
  }

  if (view() === 'locked' && token()) {
    reload().then((ok) => {
      if (!ok) {
        sessionStorage.removeItem(TOKEN_KEY);
        notice('The agent refused the stored token.', true);
      }
    }, (error) => notice('Cannot reach the agent: ' + error.message, true));
  } else {
    start();
  }
})();
