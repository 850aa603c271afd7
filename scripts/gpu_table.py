"""Print the summary table of a scripts/gpu_check.sh run (the last thing it shows)."""

import glob
import json
import os
import sys

out = sys.argv[1]


def _brief(row: dict, width: int = 160) -> str:
    """A row without the reference columns: its other keys' scalars, flattened (a.b=v)."""
    def flat(x, pre=""):
        if isinstance(x, dict):
            for k, v in x.items():
                if k not in ("test", "gpus", "passed", "layout", "tokens", "mismatches"):
                    yield from flat(v, f"{pre}{k}.")
        elif isinstance(x, float):
            yield f"{pre[:-1]}={x:.4g}"
        elif isinstance(x, (int, bool, str)) or x is None:
            yield f"{pre[:-1]}={x}"
    res = row.get("result")
    parts = [*flat({k: v for k, v in row.items() if k != "result"})]
    parts += [*flat(res)] if isinstance(res, dict) else []
    text = ", ".join(parts)
    return text if len(text) <= width else text[: width - 3] + "..."


print("\n== GPU check summary ==")
print(f"{'check':34s} {'layout':16s} {'GPUs':>4s} {'result':>7s} {'max|dlogp|':>10s} "
      f"{'mean|dlogp|':>11s} {'tok/s':>9s}")
path = os.path.join(out, "gpu_tests.jsonl")
rows = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
for r in rows:
    if r["test"] == "pd_overlap":
        n, f = r["normal"], r["fine"]
        print(f"{'pd_overlap (bf16, CUDA events)':34s} {r['layout']:16s} {r['gpus']:4d} "
              f"{'PASS' if r['passed'] else 'FAIL':>7s}   long P epoch {f['p_window_ms']:.1f} ms "
              f"(Normal {n['p_window_ms']:.1f}); D iterations inside it: Fine {f['d_inside']}, "
              f"Normal {n['d_inside']}; longest D gap Fine {f['d_gap_max_ms']:.1f} ms vs Normal "
              f"{n['d_gap_max_ms']:.1f} ms; D ms inside/outside {f['d_ms_inside']:.2f}/"
              f"{f['d_ms_outside']:.2f}; host syncs while enqueuing P/D {f['syncs']}")
        if "balanced" in r:
            b = r["balanced"]
            print(f"{'pd_overlap, balanced span':34s} {r['layout']:16s} {r['gpus']:4d} "
                  f"{'':>7s}   long P epoch {b['p_window_ms']:.1f} ms; D inside {b['d_inside']}; "
                  f"longest D gap {b['d_gap_max_ms']:.1f} ms; final K {b['final_span']}; "
                  f"host syncs {b['syncs']}")
        continue
    if r["test"] == "bf16_by_layer":
        ratios = " ".join(f"{x['point']}:{x['engine']:.4f}/{x['megatron']:.4f}" for x in r["rows"])
        print(f"{'bf16 |h-h32| engine/megatron':34s} {r['layout']:16s} {r['gpus']:4d} "
              f"{'info':>7s}   {ratios}")
        continue
    if r["test"] == "memory_phases":
        x = r["result"]
        parts = "; ".join(f"{p} {x[p]['engine_mb']:.0f}->{x[p]['released_engine_mb']:.0f}->"
                          f"{x[p]['resumed_engine_mb']:.0f} MB" for p in ("keep", "offload", "discard"))
        print(f"{'memory release/resume (engine MB)':34s} {r['layout']:16s} {r['gpus']:4d} "
              f"{'PASS' if r['passed'] else 'FAIL':>7s}   KV {x['kv_mb']:.0f} MB, weights "
              f"{x['weights_mb']:.0f} MB; {parts}")
        continue
    if r["test"] == "decode_graphs":
        x = r["result"]
        print(f"{'decode_graphs (bf16) vs eager D':34s} {r['layout']:16s} {r['gpus']:4d} "
              f"{'PASS' if r['passed'] else 'FAIL':>7s}   identical {x['first']['identical']:.0%}"
              f" (max dlogp {x['first']['max_dlogp']:.4f}); generate {x['t_eager_s']:.2f} s eager"
              f" / {x['t_graph_s']:.2f} s graphs = {x['t_eager_s'] / x['t_graph_s']:.2f}x; "
              f"graphs {x['graph_keys']}; re-captures reload/replace "
              f"{x['recaptured_after_reload']}/{x['recaptured_after_replace']}")
        continue
    if "max_logprob_diff" not in r:  # a row of its own shape: its scalars, as recorded
        print(f"{r['test']:34s} {str(r.get('layout', '')):16s} {r.get('gpus', 0):4d} "
              f"{'PASS' if r.get('passed') else 'FAIL':>7s}   {_brief(r)}")
        continue
    print(f"{r['test']:34s} {r['layout']:16s} {r['gpus']:4d} "
          f"{'PASS' if r['passed'] else 'FAIL':>7s} {r['max_logprob_diff']:10.4f} "
          f"{r['mean_logprob_diff']:11.5f} {r['tok_per_s']:9.1f}"
          + (f"   megatron-bf16 mean {r['megatron_bf16_mean_diff']:.4f}, argmax agree "
             f"{r['argmax_agreement']:.1%}"
             + (f" (megatron {r['megatron_argmax_agreement']:.1%})"
                if r.get("megatron_argmax_agreement") is not None else "")
             if r.get("megatron_bf16_mean_diff") is not None else ""))
for f in sorted(glob.glob(os.path.join(out, "demo_gpu*.json"))):
    r = json.load(open(f))
    n = os.path.basename(f)[len("demo_gpu"):-len(".json")]
    print(f"{'demo (bf16, ' + str(r['requests']) + ' req)':34s} {r['layout']:16s} {int(n):4d} "
          f"{'ok':>7s} {'':10s} {'':11s} {r['tokens_per_s']:9.1f}   "
          f"p50/p99 latency {r['latency_s']['p50']:.2f}/{r['latency_s']['p99']:.2f} s, "
          f"TTFT p99 {r['ttft_s']['p99']:.3f} s, {r['requests_per_s']:.2f} req/s")
for n in (2, 1):
    f = os.path.join(out, f"bench{n}", "bench.json")
    if not os.path.exists(f):
        part = os.path.join(out, f"bench{n}", "runs_partial.jsonl")
        if os.path.exists(part):
            k = sum(1 for _ in open(part))
            print(f"{'bench (incomplete)':34s} {'':16s} {n:4d} {'cut':>7s}   {k} replays in {part}")
        continue
    b = json.load(open(f))
    for w, cells in b["summary"].items():
        norm = cells.get("normal")
        parts = []
        for v, c in cells.items():
            ms = c["makespan_s"]["median"]
            part = f"{v} {ms:.2f}s"
            if norm and v != "normal":  # the issue's target: makespan, p99 TTFT, mean D wait
                med = lambda m, x=c: x[m]["median"] / max(norm[m]["median"], 1e-9)
                part += (f" ({100 * (med('makespan_s') - 1):+.0f}%, TTFT x{med('ttft_p99_s'):.2f},"
                         f" D wait /{1 / max(med('mean_d_wait_ms'), 1e-9):.1f})")
            parts.append(part)
        print(f"{'bench makespan, wait x' + w:34s} {b['layout']:16s} {n:4d} {'info':>7s}   "
              + ", ".join(parts))
if not rows:
    print("(no GPU test results: see pytest.log)")
