// k6 script of `make bench`'s legacy row (bench/legacy.py): closed loop, VUS clients, each
// sending its next chat completion when the last is answered, for DURATION. Prompts are
// distinct (PREFIX, the client, its iteration), so no cache answers any of them. STREAM=1
// streams every answer (a request's time is then its whole stream's).
import http from 'k6/http';
import { check } from 'k6';

const url = __ENV.URL;
const params = { headers: { 'content-type': 'application/json', authorization: `Bearer ${__ENV.KEY}` } };

export const options = {
  vus: Number(__ENV.VUS || 1),
  duration: __ENV.DURATION || '4s',
  discardResponseBodies: true,
  summaryTrendStats: ['med', 'p(99)', 'avg', 'count'],
  noConnectionReuse: false,
};

export default function () {
  const body = JSON.stringify({
    model: __ENV.MODEL, max_tokens: Number(__ENV.MAX_TOKENS || 8), temperature: 0, stream: __ENV.STREAM === '1',
    messages: [{ role: 'user', content: `${__ENV.PREFIX} ${__VU} ${__ITER}` }],
  });
  check(http.post(url, body, params), { ok: (r) => r.status === 200 });
}
