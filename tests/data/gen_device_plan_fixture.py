#!/usr/bin/env python3
"""Writes tests/data/device_plan_fixture.txt: a small routing trace with its expected LRU plans.

The expectations come from this file's own LRU model (an OrderedDict), written independently of
the C++ planners, so the fixture is a third opinion next to ForwardPlanner<Lru> and the device
planning code. Semantics: unique valid ids in ascending order; -1 is padding; any other id
outside [0, E) is a bad id (dropped, counted); more unique ids than slots are planned as groups
of C ascending ids; a miss pops the LIFO free stack (initially [C-1, ..., 0]: slot 0 first), else
evicts the least recently used resident outside its group. Run: python3 gen_device_plan_fixture.py
"""
import random
from collections import OrderedDict

E, C, TOP_K, STEPS, SEED = 16, 6, 2, 40, 12
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


class Lru:
    def __init__(self):
        self.slot = {}               # expert -> slot
        self.order = OrderedDict()   # least recently used first
        self.free = list(range(C - 1, -1, -1))

    def plan(self, group):
        hits, fills, evictions = 0, [], []
        protected = set(group)
        for e in group:
            if e in self.slot:
                hits += 1
                self.order.move_to_end(e)
                continue
            if self.free:
                s = self.free.pop()
            else:
                victim = next(v for v in self.order if v not in protected)
                s = self.slot.pop(victim)
                del self.order[victim]
                evictions.append((victim, s))
            self.slot[e] = s
            self.order[e] = None
            fills.append((e, s))
        return hits, fills, evictions

    def invalidate(self, e):
        if e in self.slot:
            self.free.append(self.slot.pop(e))
            del self.order[e]


def pairs(xs):
    return " ".join(f"{e}:{s}" for e, s in xs) if xs else "-"


def main():
    rng = random.Random(SEED)
    lru = Lru()
    out = [f"# device-plan fixture v1: written by gen_device_plan_fixture.py (seed {SEED}); do not edit",
           "# shape E C top_k | step ids... | group g hits misses fills(e:s) evictions(e:s) | invalidate e",
           f"shape {E} {C} {TOP_K}"]
    hot = [0, 3, 5, 9]
    for step in range(STEPS):
        if step in (11, 27):
            e = rng.choice(sorted(lru.slot))
            lru.invalidate(e)
            out.append(f"invalidate {e}")
        tokens = rng.choice([1, 1, 2, 2, 3, 4]) if step not in (8, 30) else 5  # 5 tokens: overflow
        ids = []
        for _ in range(tokens):
            row = set()
            while len(row) < TOP_K:
                row.add(rng.choice(hot) if rng.random() < 0.5 else rng.randrange(E))
            ids.extend(sorted(row, key=lambda _: rng.random()))
        if rng.random() < 0.3:
            ids[rng.randrange(len(ids))] = -1
        if step in (5, 19, 33):
            ids[rng.randrange(len(ids))] = rng.choice([E, E + 7, INT32_MAX, INT32_MIN, -2])
        out.append("step " + " ".join(map(str, ids)))
        uniq = sorted({i for i in ids if 0 <= i < E})
        for g in range(0, len(uniq), C):
            hits, fills, evictions = lru.plan(uniq[g:g + C])
            out.append(f"group {g // C} {hits} {len(fills)} {pairs(fills)} | {pairs(evictions)}")
    with open(__file__.replace("gen_device_plan_fixture.py", "device_plan_fixture.txt"), "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
