"""Is the new tree faster than the old one? A markdown table per shape from the alternating A/B benchmark runs
of `device_run.sh ab` (ab_old_<i>.json, ab_new_<i>.json: records of python -m mok_nn.bench).

    python benchmarks/ab_table.py DIR

Each table lists every run (mok_nn's fwd / bwd ms and the torch baseline's of the same run: a drifting
baseline shows a drifting GPU; mok_nn's peak GB of a forward+backward and activation GB kept for the
backward), then the median over the runs of each tree and the ratio new / old (below 1: the new tree is
faster, or takes less memory). Every mok_nn implementation the records hold gets its tables (with
--precision mxfp8: mok_nn_mxfp8, mok_nn_frozen, mok_nn_mxfp8_frozen beside mok_nn), headed "### <shape>"
for mok_nn and "### <shape>, <impl>" for the others.
"""
import argparse
import json
import pathlib
import re
import statistics
import sys


def load(directory):
    """[(tree, i, records)] of DIR/ab_{old,new}_<i>.json, in run order (i, then old before new)."""
    runs = []
    for path in pathlib.Path(directory).glob("ab_*_*.json"):
        m = re.fullmatch(r"ab_(old|new)_(\d+)\.json", path.name)
        if m:
            runs.append((m.group(1), int(m.group(2)), json.loads(path.read_text())))
    return sorted(runs, key=lambda r: (r[1], r[0] != "old"))


def _num(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _key(r) -> str:
    return r["shape"] if r.get("ep", 1) == 1 else f"{r['shape']} EP={r['ep']}"


def tables(runs):
    """The markdown text: one table per shape (and EP size where it is not 1) and mok_nn implementation."""
    keys = []
    for _, _, records in runs:
        for r in records:
            if r["impl"].startswith("mok_nn") and (_key(r), r["impl"]) not in keys:
                keys.append((_key(r), r["impl"]))
    out = []
    for key, impl in keys:
        title = key if impl == "mok_nn" else f"{key}, {impl}"
        out += [f"### {title}", "", "| run | fwd ms | bwd ms | baseline fwd ms | baseline bwd ms | peak GB | act GB |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        times = {"old": ([], [], [], []), "new": ([], [], [], [])}
        for tree, i, records in runs:
            got = {r["impl"]: r for r in records if _key(r) == key}
            mok, base = got.get(impl), got.get("torch_baseline")
            if mok is None:
                continue
            for column, field in enumerate(("fwd_ms", "bwd_ms", "peak_mem_gb", "act_mem_gb")):
                if mok.get(field) is not None:
                    times[tree][column].append(mok[field])
            bf, bb = (f"{base['fwd_ms']:.3f}", f"{base['bwd_ms']:.3f}") if base else ("-", "-")
            out.append(f"| {tree} {i} | {mok['fwd_ms']:.3f} | {mok['bwd_ms']:.3f} | {bf} | {bb} | "
                       f"{_num(mok.get('peak_mem_gb'))} | {_num(mok.get('act_mem_gb'))} |")
        med = {t: [statistics.median(v) if v else None for v in cols] for t, cols in times.items()}
        for tree in ("old", "new"):
            if med[tree][0] is not None:
                m = med[tree]
                out.append(f"| {tree} (median of {len(times[tree][0])}) | {m[0]:.3f} | {m[1]:.3f} | | | "
                           f"{_num(m[2])} | {_num(m[3])} |")
        if med["old"][0] is not None and med["new"][0] is not None:
            ratio = [_num(n / o if n is not None and o else None) for n, o in zip(med["new"], med["old"])]
            out.append(f"| new / old | {ratio[0]} | {ratio[1]} | | | {ratio[2]} | {ratio[3]} |")
        out.append("")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory", help="folder holding ab_old_<i>.json and ab_new_<i>.json")
    a = ap.parse_args(argv)
    runs = load(a.directory)
    if not runs:
        print(f"no ab_old_<i>.json / ab_new_<i>.json in {a.directory}")
        return 1
    print(tables(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
