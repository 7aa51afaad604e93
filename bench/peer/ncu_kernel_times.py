#!/usr/bin/env python3
"""Sums ncu's per-kernel durations (ncu --csv --page raw --metrics gpu__time_duration.sum) by kernel name and
prints the table, largest first: where a profiled region's device time goes."""
import collections, csv, sys

rows = list(csv.reader(open(sys.argv[1])))
head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
names = rows[head]
k, t = names.index("Kernel Name"), names.index("gpu__time_duration.sum")
total, count = collections.Counter(), collections.Counter()
for r in rows[head + 2:]:
    if len(r) <= max(k, t):
        continue
    try:
        ns = float(r[t].replace(",", ""))
    except ValueError:
        continue
    name = r[k][:90]
    total[name] += ns
    count[name] += 1
grand = sum(total.values())
print(f"total {grand / 1e3:.1f} us over {sum(count.values())} kernels")
for name, ns in total.most_common(25):
    print(f"{ns / 1e3:10.1f} us {100 * ns / grand:5.1f}% {count[name]:5d}x  {name}")
