"""Plots bench.py --json result lines (one file of them) against the roofline:
tools/plot_bench.py LOG PNG."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
def label(r: dict) -> str:
    if r["engine"] != "nanovllm":
        return f"{r['engine']}\nbf16"
    # older lines: sync
    sched = {True: "async", False: "sync"}.get(r.get("async_scheduling"), "sync")
    extra = [r["model"]] if r["model"] != rows[0]["model"] else []
    extra += [f"TP={r['tp']}"] if r.get("tp", 1) > 1 else []
    extra += ["profiled"] if "gpu_busy_fraction" in r else []
    return "\n".join([r["attention_backend"], "graphs" if r["cuda_graphs"] else "eager", sched,
                      *extra])


labels = [label(r) for r in rows]
fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4.5))
ax.bar(range(len(rows)), [r["tok_per_s"] for r in rows],
       color=["C0" if r["engine"] == "nanovllm" else "C1" for r in rows])
for i, r in enumerate(rows):
    ax.text(i, r["tok_per_s"], f"{r['tok_per_s']:,.0f}", ha="center", va="bottom", fontsize=8)
limits = [r["roofline_tok_per_s"] for r in rows if "roofline_tok_per_s" in r]
if limits:
    ax.axhline(limits[0], color="k", ls="--", lw=1, label=f"roofline {limits[0]:,} tok/s")
    ax.legend()
ax.set_xticks(range(len(rows)), labels, fontsize=8)
ax.set_ylabel("output tok/s")
ax.set_title(f"bench.py, {rows[0]['model']}, {rows[0]['num_seqs']} seqs, {rows[0]['device']}, "
             f"{rows[0]['date'][:10]}")
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
