"""Redis access for the hard examples (engine.quality.hard_examples): per task, at most `size` inputs
the model was unsure of, with its answer, how often each was asked and the operator's label.

Every key of one task shares the hash tag `{task}` (one slot, one primary, also on a Redis
Cluster), lives under the meta prefix (an operator's flush leaves it; the L2 clean-up never
matches it) and carries the TTL `HARD_EXAMPLES_TTL_S`, refreshed at every write:

    {prefix}:meta:hard:{task}:inputs  hash  id -> the input (b"t" + UTF-8 text, b"i" + PNG)
    {prefix}:meta:hard:{task}:info    hash  id -> JSON: kind, reason, the model's answer, first seen
    {prefix}:meta:hard:{task}:answer  hash  id -> JSON: the model's latest answer (after a reload)
    {prefix}:meta:hard:{task}:label   hash  id -> JSON: state, label, by, at (once an operator acted)
    {prefix}:meta:hard:{task}:asked   hash  id -> times asked (every replica adds its counts)
    {prefix}:meta:hard:{task}:seen    zset  id -> last time asked
    {prefix}:meta:hard:{task}:rank    zset  id -> eviction order, lowest first (labelled: absent)

Adding and evicting is one Lua script per task and flush, so replicas adding at once never
keep more than `size`: a new input takes the place of the lowest-ranked one only if it ranks
higher. Rank = times asked, then last seen (the least asked and oldest go first); a skipped
example ranks as asked 0; a labelled one (or "none of these") is never evicted by newcomers:
an operator's work is kept until it is exported and deleted, or its TTL runs out.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from storage.redis.store import RedisStore

FIELDS = ("inputs", "info", "label", "asked", "seen", "rank", "answer")
# Times asked count in the rank up to this; then recency (a double holds asked * 1e10 + epoch
# seconds below 2**53; at small counts to the microsecond). A newcomer wins a tie: it is newer.
MAX_RANKED_ASKS = 900_000

# KEYS: the keys of FIELDS. ARGV: size, ttl_s, then per entry: id, input ("" for a kept one),
# info JSON (for a kept one: its latest answer, or ""), asked increment, when last asked.
# Returns {added, updated, evicted, refused}.
_ADD_SCRIPT = """
local size, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local inputs, info, label, asked, seen, rank, answer = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5],
  KEYS[6], KEYS[7]
local added, updated, evicted, refused = 0, 0, 0, 0
local function score(n, state, now)
  if state == 'skipped' then n = 0 end
  return math.min(n, 900000) * 1e10 + now
end
local function state_of(id)
  local raw = redis.call('HGET', label, id)
  if not raw then return 'pending' end
  return cjson.decode(raw)['state']
end
for i = 3, #ARGV, 5 do
  local id, input, meta, inc = ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3])
  local now = tonumber(ARGV[i + 4])
  if redis.call('HEXISTS', info, id) == 1 then
    local n = redis.call('HINCRBY', asked, id, inc)
    redis.call('ZADD', seen, now, id)
    if redis.call('ZSCORE', rank, id) then
      redis.call('ZADD', rank, score(n, state_of(id), now), id)
    end
    if meta ~= '' then redis.call('HSET', answer, id, meta) end
    updated = updated + 1
  elseif input ~= '' then
    local mine = score(inc, 'pending', now)
    local room = redis.call('HLEN', info) < size
    if not room then
      local lowest = redis.call('ZRANGE', rank, 0, 0, 'WITHSCORES')
      if lowest[1] and tonumber(lowest[2]) <= mine then
        local victim = lowest[1]
        redis.call('HDEL', inputs, victim)
        redis.call('HDEL', info, victim)
        redis.call('HDEL', label, victim)
        redis.call('HDEL', asked, victim)
        redis.call('HDEL', answer, victim)
        redis.call('ZREM', seen, victim)
        redis.call('ZREM', rank, victim)
        evicted = evicted + 1
        room = true
      end
    end
    if room then
      redis.call('HSET', inputs, id, input)
      redis.call('HSET', info, id, meta)
      redis.call('HSET', asked, id, inc)
      redis.call('ZADD', seen, now, id)
      redis.call('ZADD', rank, mine, id)
      added = added + 1
    else
      refused = refused + 1
    end
  end
end
for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ttl) end
return {added, updated, evicted, refused}
"""

# KEYS: the keys of FIELDS. ARGV: id, label JSON, state, now. Returns 0 when the id is not kept.
_LABEL_SCRIPT = """
local id, record, state, now = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
if redis.call('HEXISTS', KEYS[2], id) == 0 then return 0 end
redis.call('HSET', KEYS[3], id, record)
if state == 'skipped' then
  redis.call('ZADD', KEYS[6], now, id)
else
  redis.call('ZREM', KEYS[6], id)
end
return 1
"""


@dataclass(frozen=True)
class AddOutcome:
    added: int = 0
    updated: int = 0  # already kept: times asked and last seen moved
    evicted: int = 0  # made room for a higher-ranked newcomer
    refused: int = 0  # full of higher-ranked or labelled examples


@dataclass(frozen=True)
class NewEntry:
    """One input for `HardExampleStore.add`: `stored` empty means "count these asks only";
    `at`: when it was last asked (its recency in the rank)."""

    id: str
    stored: bytes
    info: dict[str, Any]
    asked: int
    at: float


class HardExampleStore:
    """The kept examples of every task in one Redis (through the store's breakers)."""

    def __init__(self, store: RedisStore, *, prefix: str) -> None:
        self._store = store
        self._prefix = prefix

    def key(self, task: str, name: str) -> str:
        return f"{self._prefix}:meta:hard:{{{task}}}:{name}"

    def _keys(self, task: str) -> list[str]:
        return [self.key(task, name) for name in FIELDS]

    def _run(self, task: str, work: Any) -> Any:
        anchor = self.key(task, "info")
        return self._store.call(lambda: work(self._store.client), key=anchor)

    def add(self, task: str, entries: Sequence[NewEntry], *, size: int, ttl_s: int) -> AddOutcome:
        """Add new inputs and count asks of kept ones (see the module docstring); one round trip."""
        if not entries:
            return AddOutcome()
        args: list[Any] = [size, int(ttl_s)]
        for entry in entries:
            info = json.dumps(entry.info, separators=(",", ":")) if entry.info else ""
            args += [entry.id, entry.stored, info, int(entry.asked), entry.at]
        keys = self._keys(task)
        reply = self._run(task, lambda client: client.eval(_ADD_SCRIPT, len(keys), *keys, *args))
        return AddOutcome(*(int(n) for n in reply))

    def ids(self, task: str) -> set[str]:
        """The ids kept now (the collector counts later asks of these only)."""
        return {raw.decode() for raw in self._run(task, lambda client: client.hkeys(self.key(task, "info")))}

    def records(self, task: str) -> list[dict[str, Any]]:
        """Every kept example without its input: info, label, times asked, last seen."""

        def read(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            pipe.hgetall(self.key(task, "info"))
            pipe.hgetall(self.key(task, "label"))
            pipe.hgetall(self.key(task, "asked"))
            pipe.zrange(self.key(task, "seen"), 0, -1, withscores=True)
            pipe.hgetall(self.key(task, "answer"))
            return pipe.execute()

        infos, labels, asked, seen, answers = self._run(task, read)
        last = {member.decode(): score for member, score in seen}
        out = []
        for raw_id, raw_info in infos.items():
            ident = raw_id.decode()
            label = json.loads(labels[raw_id]) if raw_id in labels else {"state": "pending"}
            latest = json.loads(answers[raw_id]) if raw_id in answers else {}
            out.append({**json.loads(raw_info), **latest, "id": ident, "asked": int(asked.get(raw_id, 0)),
                        "last_seen": last.get(ident), **label})  # fmt: skip
        return out

    def inputs(self, task: str, ids: Sequence[str]) -> dict[str, bytes]:
        """The stored inputs of these ids (those still kept)."""
        if not ids:
            return {}
        values = self._run(task, lambda client: client.hmget(self.key(task, "inputs"), list(ids)))
        return {ident: value for ident, value in zip(ids, values, strict=True) if value is not None}

    def set_label(self, task: str, ident: str, record: dict[str, Any], *, now: float) -> bool:
        """Record an operator's decision; False when `ident` is not kept (evicted, expired)."""
        keys = self._keys(task)
        blob = json.dumps(record, separators=(",", ":"))
        args = [ident, blob, record["state"], now]
        return bool(self._run(task, lambda client: client.eval(_LABEL_SCRIPT, len(keys), *keys, *args)))

    def delete(self, task: str, ident: str) -> bool:
        def remove(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=True)
            pipe.hdel(self.key(task, "info"), ident)
            for name in ("inputs", "label", "asked", "answer"):
                pipe.hdel(self.key(task, name), ident)
            for name in ("seen", "rank"):
                pipe.zrem(self.key(task, name), ident)
            return pipe.execute()

        return bool(self._run(task, remove)[0])

    def clear(self, task: str) -> int:
        """Drop every kept example of `task`; returns how many there were."""
        count = int(self._run(task, lambda client: client.hlen(self.key(task, "info"))))
        self._run(task, lambda client: client.unlink(*self._keys(task)))
        return count

    def memory_bytes(self, task: str) -> int:
        """Redis's own account of what the task's keys take (MEMORY USAGE, all samples)."""

        def usage(client: Any) -> int:
            return sum(int(client.memory_usage(key, samples=0) or 0) for key in self._keys(task))

        return self._run(task, usage)
