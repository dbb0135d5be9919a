#!/usr/bin/env python3
"""Summarises `loraplex bench kernels --trace` output: per prefill case, the kernel's span, when
CTAs started, the median / 90th-percentile time of each phase of a CTA, and how CTAs landed on SMs
(CTAs per SM against the time their SM finished); per decode-pair or cluster-layer linear case
(four consecutive calls of a graph replay), the medians over calls of the steps of one call."""
import collections
import gzip
import json
import statistics
import sys

# (name, from slot, to slot) per op; slot 0 is the SM, 1..7 the points of kernel_trace.h.
PHASES = {
    "shrink": [("metadata", 1, 2), ("setup", 2, 3), ("first stage", 3, 4), ("K loop", 4, 5),
               ("reduction", 5, 6), ("exit", 6, 7)],
    "expand": [("metadata", 1, 2), ("first tokens", 2, 3), ("first data", 3, 4),
               ("items", 4, 6), ("exit", 6, 7)],
}


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


# One call of the decode pair (gather_lora.cu): shrink rows have slot 1 set (1 entry, 2 wait
# returned, 3 loads landed, 4 exit), expand rows slots 5-7 (entry, wait returned, exit).
PAIR_STEPS = ["previous exit -> shrink wait", "shrink loads landed", "shrink last exit",
              "expand wait", "expand last exit", "period"]


def pair_steps(prev, rows):
    prev_exit = max(r[7] for r in prev if not r[1] and r[7])
    shrink = [r for r in rows if r[1]]
    expand = [r for r in rows if not r[1] and r[5]]
    wait = min(r[2] for r in shrink)
    landed = statistics.median([r[3] for r in shrink if r[3]])
    shrink_exit = max(r[4] for r in shrink)
    expand_wait = min(r[6] for r in expand if r[6])
    expand_exit = max(r[7] for r in expand if r[7])
    points = [prev_exit, wait, landed, shrink_exit, expand_wait, expand_exit]
    return [(b - a) / 1e3 for a, b in zip(points, points[1:])] + [(expand_exit - prev_exit) / 1e3]


# One call of the cluster layer (cluster_lora.cu): slots 1 entry, 2 PDL wait returned, 3 loads
# landed, 4 partial sums sent, 5 partial sums received, 6 rounded sums received, 7 exit.
CLUSTER_STEPS = ["previous exit -> first wait", "loads landed", "partials sent",
                 "partials received", "sums received", "last exit", "period"]


def cluster_steps(prev, rows):
    prev_exit = max(r[7] for r in prev if r[7])
    wait = min(r[2] for r in rows if r[2])
    points = [prev_exit, wait]
    for k in (3, 4, 5, 6):
        points.append(statistics.median([r[k] for r in rows if r[k]]))
    points.append(max(r[7] for r in rows if r[7]))
    return [(b - a) / 1e3 for a, b in zip(points, points[1:])] + [(points[-1] - prev_exit) / 1e3]


def summarise_pair(c):
    cluster = c.get("path") == "cluster"
    step_of = cluster_steps if cluster else pair_steps
    steps = [step_of(p, r) for p, r in zip(c["calls"], c["calls"][1:])]
    print(f"linear rank {c['rank']} adapters {c['adapters']} tokens {c['tokens']} slices "
          f"{c['slices']} ({c.get('path', 'gather')}): {c['rotating_us']:.2f} us per call "
          f"untraced; medians over {len(steps)} traced calls:")
    for k, name in enumerate(CLUSTER_STEPS if cluster else PAIR_STEPS):
        print(f"  {name:30s} {statistics.median(s[k] for s in steps):6.2f} us")


# Traces are kept gzip-compressed in bench/results.
opener = gzip.open if sys.argv[1].endswith(".gz") else open
for line in opener(sys.argv[1], "rt"):
    c = json.loads(line)
    if "calls" in c:
        summarise_pair(c)
        continue
    rows = c["ctas"]
    if not rows:  # the case ran another shrink path
        continue
    full = [r for r in rows if r[7]]
    t0 = min(r[1] for r in rows)
    span = max(r[7] for r in full) - t0 if full else 0
    print(f"{c['op']} rank {c['rank']} adapters {c['adapters']} tokens {c['tokens']} slices "
          f"{c['slices']}: {len(rows)} CTAs ({len(full)} worked), span {span / 1e3:.2f} us, "
          f"entry spread {(max(r[1] for r in rows) - t0) / 1e3:.2f} us")
    for name, a, b in PHASES[c["op"]]:
        d = [(r[b] - r[a]) / 1e3 for r in full if r[a] and r[b]]  # 0: point not reached
        if d:
            print(f"  {name:12s} median {statistics.median(d):6.2f} us  p90 {pct(d, 0.9):6.2f}  "
                  f"max {max(d):6.2f}")
    per_sm = collections.defaultdict(list)
    for r in full:
        per_sm[r[0]].append(r)
    by_count = collections.defaultdict(list)
    for sm, rs in per_sm.items():
        by_count[len(rs)].append((max(r[7] for r in rs) - t0) / 1e3)
    print("  SMs by CTAs:", ", ".join(
        f"{n} CTAs: {len(v)} SMs (finish median {statistics.median(v):.2f} us)"
        for n, v in sorted(by_count.items())), f"; {len(per_sm)} SMs used")
