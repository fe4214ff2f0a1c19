"""Per-layer kernel table of a decode step from a ktrace file (ktrace.c).

usage: python3 ktrace_layers.py TRACE [LAYERS]   (LAYERS: 32, Llama-3-8B)

Steps end at the argmax kernel; the last 10 are taken. Within a step the
first two kernels (embedding, the first norm) and the last three (gather,
lm_head, argmax) are outside the layers; the rest repeat LAYERS times, and
kernel i of a layer is slot Li. Each slot: its mean time, the mean gap from
the kernel before it ends to it starting (negative: launched early, PDL),
and its total per step."""
import collections
import sys

rows = []
for line in open(sys.argv[1]):
    p = line.split(' ', 5)
    rows.append((int(p[0]), int(p[1]), int(p[2]), int(p[3]), int(p[4]), p[5].strip()))
rows.sort()
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 32
ends = [i for i, r in enumerate(rows) if 'argmax' in r[5]]
steps = [rows[a + 1:b + 1] for a, b in zip(ends[-11:-1], ends[-10:])]
n = len(steps)
slots = collections.defaultdict(lambda: [0.0, 0.0, '', 0])
for st in steps:
    per = (len(st) - 5) // layers
    for i, r in enumerate(st):
        if 2 <= i < 2 + per * layers:
            key = 'L%d' % ((i - 2) % per)
        else:
            key = 'x%d' % (i if i < 2 else i - (2 + per * layers) + 100)
        e = slots[key]
        e[0] += r[1] - r[0]
        e[1] += r[0] - st[i - 1][1] if i else 0
        e[2] = r[5][:50] + ' g%d' % r[3]
        e[3] += 1
print('steps', n, 'step us %.1f' % (sum(s[-1][1] - s[0][0] for s in steps) / n / 1e3))
for k in sorted(slots, key=lambda k: (k[0], int(k[1:]))):
    d, g, name, c = slots[k]
    print('%-5s avg %7.2f us gap %5.2f us  total/step %7.1f  %s' % (k, d / c / 1e3, g / c / 1e3, d / n / 1e3, name))
