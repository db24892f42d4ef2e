"""Load test of the Gradio demo: N concurrent questions through `gradio_client`, p50/p95 latency.

Against a running demo:
    python scripts/load_test_demo.py --url http://127.0.0.1:7860 --requests 20
Or start one in this process from a checkpoint (the demo's own settings: queue, concurrency limit):
    python scripts/load_test_demo.py --checkpoint runs/quickstart/final --requests 20

Each request is timed on the client from submit to result, so queueing time counts. Prints a markdown
table, then one line of JSON (`--json-out FILE` also writes it there).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from atomicio import atomic_write_text

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between closest ranks."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def load_test(
    url: str, questions: list[str], requests: int, k: int, concurrency: int, warmup: int = 1
) -> dict:
    """Send `requests` questions (cycling `questions`) with `concurrency` in flight; latencies in seconds.

    `warmup` untimed requests go first, one at a time: the client's first call opens its event stream and
    the server's first call starts its queue workers (about a second, once per client and per server).
    """
    from gradio_client import Client

    client = Client(url, verbose=False, download_files=False, analytics_enabled=False)
    cold = []
    for i in range(warmup):
        start = time.perf_counter()
        client.predict(questions[i % len(questions)], k, api_name="/answer")
        cold.append(round(time.perf_counter() - start, 3))

    def one(i: int) -> dict:
        question = questions[i % len(questions)]
        start = time.perf_counter()
        try:
            answer, latency_line, passages_html, result = client.predict(question, k, api_name="/answer")
        except Exception as err:  # a failed request is a result of the load test, not a crash of it
            return {
                "ok": False,
                "error": f"{type(err).__name__}: {err}",
                "seconds": time.perf_counter() - start,
            }
        seconds = time.perf_counter() - start
        # The status line reads "confidence 83% · 45 ms · top-4 passages" (or a low-confidence warning first).
        match = re.search(r"(\d+) ms\b", latency_line or "")
        server = float(match.group(1)) / 1000 if match else None  # the model's share, as the page shows it
        return {"ok": bool(passages_html) and match is not None, "seconds": seconds, "server": server}

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - started
    latencies = [r["seconds"] for r in results if r["ok"]]
    server = [r["server"] for r in results if r["ok"]]
    return {
        "url": url,
        "warmup_s": cold,
        "requests": requests,
        "concurrency": concurrency,
        "k": k,
        "answered": len(latencies),
        "errors": [r["error"] for r in results if "error" in r][:5],
        "p50_s": round(percentile(latencies, 50), 3),
        "p95_s": round(percentile(latencies, 95), 3),
        "max_s": round(max(latencies, default=float("nan")), 3),
        "server_p50_s": round(percentile(server, 50), 3),
        "wall_s": round(wall, 3),
        "throughput_qps": round(len(latencies) / wall, 2) if wall > 0 else None,
    }


def format_table(report: dict) -> str:
    """The report as a markdown table."""
    from rlm.experiments.reporting import table

    rows = {
        "untimed warm-up requests (s)": ", ".join(f"{s:.3f}" for s in report["warmup_s"]) or "none",
        "requests answered": f"{report['answered']} / {report['requests']}",
        "in flight at once": report["concurrency"],
        "passages per question (k)": report["k"],
        **{f"{q} latency": f"{report[f'{q}_s']:.3f} s" for q in ("p50", "p95", "max")},
        "p50 of the model's share (batch)": f"{report['server_p50_s']:.3f} s",
        "wall time": f"{report['wall_s']:.2f} s",
        "throughput": f"{report['throughput_qps']} questions/s",
    }
    return table(
        [{"measure": k, "value": v} for k, v in rows.items()],
        [("measure", "measure", ""), ("value", "value", "")],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", help="a running demo, e.g. http://127.0.0.1:7860")
    source.add_argument("--checkpoint", help="start the demo in this process from a checkpoint folder")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=None, help="in flight at once (default: all)")
    parser.add_argument("--k", type=int, default=4, help="passages per question")
    parser.add_argument("--question", action="append", help="question to ask (repeatable; default: dev set)")
    parser.add_argument("--port", type=int, default=7861, help="port for --checkpoint")
    parser.add_argument("--server-concurrency", type=int, default=2, help="the demo's concurrency limit")
    parser.add_argument(
        "--max-batch-size", type=int, default=8, help="the demo's batch size (1: no batching)"
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed requests sent first, one at a time (0: none)"
    )
    parser.add_argument("--json-out", help="also write the JSON report here")
    args = parser.parse_args(argv)

    questions = args.question or []
    demo = None
    url = args.url
    if args.checkpoint:
        import torch

        from app.demo import build_demo, launch_kwargs
        from app.qa import QAService

        torch.set_num_threads(1)  # as `rlm demo` does: requests run side by side, one thread each
        service = QAService.from_checkpoint(args.checkpoint)
        questions = questions or service.examples
        demo = build_demo(
            service, concurrency_limit=args.server_concurrency, max_batch_size=args.max_batch_size
        )
        _, url, _ = demo.launch(
            prevent_thread_lock=True, **launch_kwargs(port=args.port, blocked=[args.checkpoint])
        )
    if not questions:
        questions = ["Where was the author born?"]
    try:
        report = load_test(
            url, questions, args.requests, args.k, args.concurrency or args.requests, args.warmup
        )
    finally:
        if demo is not None:
            demo.close()
    print(format_table(report))
    line = json.dumps(report)
    print(line)
    if args.json_out:
        atomic_write_text(args.json_out, line + "\n")
    return 0 if report["answered"] == report["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
