"""Exact lookahead (``speculate="auto"``, the default) against one token per step (``speculate=0``).

Five tasks on the default model (``ms.load_text_model()``), prompts below: a summary of an article,
a code rewrite with one variable renamed, an answer quoting its context, fields extracted as JSON
(with a schema), an open-ended story. For each: decode tokens/s (after the first token) of both,
their ratio, tokens per decode step and whether the two texts are identical (they must be: the
lookahead is exact). Then 8 concurrent streams (the five tasks, cycled), aggregate tokens/s.

Rounds are interleaved, the order alternating (default then speculate=0, then speculate=0 then
default, ...), and medians reported, so a noisy machine affects both alike; the load average is
printed with the figures. Tokens/s are the medians of the rounds; a ratio is the median of the
rounds' own ratios (`paired`: both readings of a round share the host's speed of the moment). Each
reading is a setting's decode rate over at least ``--min-decode`` seconds (0.5): a task whose answer
decodes faster (the quote's 25 tokens: about 0.15 s) is streamed again until its decodes add up to
that, ours and llama.cpp's alike, each after a short pause (`SETTLE_S`). The last lines count the
kernel calls that ran on one thread because another process had taken a core mid-call
(`NativeKernels.contention`), by task and setting: many of them mean the host was busy and the
figures are not to be trusted.

llama.cpp (llama-cpp-python, when it is installed) runs the same GGUF file on the same prompts
(our chat template's text; the JSON task with the schema as its grammar), greedy, with as many
threads as torch uses, each configuration in a process of its own (no torch loaded, as
`llama_cpp_stream.py` does): plain, and with `LlamaPromptLookupDecoding(num_pred_tokens=K)` for
K in 2, 4, 10 (``--lookups``), whose best is reported. Its rounds are interleaved with ours.
llama-cpp-python 0.3.16 runs prompt lookup (with ``logits_all=True``, see `llama_cpp_stream.py`);
0.3.36 crashes (SIGSEGV) as soon as a draft model is given, so with it pass ``--lookups ''``.

    python benchmarks/lookahead.py [--rounds 4] [--tokens 128] [--only summary,code] [--no-batch]
                                   [--no-llama-cpp] [--lookups 2,4,10] [--min-decode 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import multistream as ms
from multistream.text._accel.kernels import native_kernels

ARTICLE = """The city council of Riverton voted on Tuesday to turn the old freight rail line that crosses the
east side of town into a public park and cycling path. The line, built in 1911 to carry grain from the
river docks to the mills, has been unused since 1987, when the last mill closed. For more than thirty
years the tracks have been fenced off, and residents have complained that the corridor collects litter
and divides neighbourhoods that were once connected by footbridges.

The plan approved this week will remove the rails, keep the historic stone bridges, and lay a paved path
four kilometres long from the riverfront to the northern edge of the city. Native grasses and fruit trees
will be planted along both sides, and three small plazas will be built where the path meets busy streets.
The council expects the work to cost 14 million dollars, of which 9 million will come from a state
transportation grant and the rest from the city's capital budget over four years.

Supporters of the project, including several local business owners, said the path would bring visitors
to shops along Market Street and give children a safe way to cycle to school. Maria Chen, who runs a
bakery near the old depot, said she had waited twenty years for the council to act. Opponents worried
about the cost and about noise for houses that back onto the corridor. Councillor David Okafor, who voted
against the plan, said the money would be better spent on repairing roads. Construction is expected to
begin next spring, and the first section, between the river and Market Street, should open in 2027."""

FUNCTION = '''def summarize_orders(orders, tax_rate, discount_codes):
    """Total the orders of one day and count what was sold."""
    totals = {}
    counts = {}
    rejected = []
    for order in orders:
        if order.status == "cancelled":
            rejected.append(order.id)
            continue
        subtotal = 0.0
        for line in order.lines:
            price = line.unit_price * line.quantity
            if line.sku in discount_codes:
                price = price * (1 - discount_codes[line.sku])
            subtotal += price
            counts[line.sku] = counts.get(line.sku, 0) + line.quantity
        tax = subtotal * tax_rate
        customer = order.customer_id
        if customer not in totals:
            totals[customer] = 0.0
        totals[customer] += subtotal + tax
    best = None
    for customer, amount in totals.items():
        if best is None or amount > totals[best]:
            best = customer
    return {
        "totals": totals,
        "counts": counts,
        "rejected": rejected,
        "best_customer": best,
    }
'''

CONTEXT = """The Hubble Space Telescope was launched on April 24, 1990, aboard the space shuttle Discovery.
Shortly after it reached orbit, engineers found that its main mirror had been ground to the wrong shape,
which blurred its images. In December 1993 astronauts on the shuttle Endeavour installed corrective
optics during the first servicing mission, and the telescope's images became sharp. Hubble orbits about
540 kilometres above the Earth and completes one orbit roughly every 95 minutes."""

PARAGRAPH = """Order 4471 was placed by Jonathan Reyes of Portland, Oregon on March 3, 2025. He bought two
walnut bookshelves at 189.50 dollars each and asked for delivery to 12 Alder Lane, with the note "leave at
the side door". He paid by credit card and his phone number is 503-555-0142."""

SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer"}, "customer": {"type": "string"}, "city": {"type": "string"},
        "item": {"type": "string"}, "quantity": {"type": "integer"}, "unit_price": {"type": "number"},
        "address": {"type": "string"}, "phone": {"type": "string"},
    },
    "required": ["order_id", "customer", "city", "item", "quantity", "unit_price", "address", "phone"],
    "additionalProperties": False,
}

TASKS: dict[str, tuple[list[dict[str, str]], dict[str, Any]]] = {
    "summary": ([{"role": "user", "content": "Summarise this article in a few sentences, keeping its key facts "
                  "and names.\n\n" + ARTICLE}], {}),
    "code": ([{"role": "user", "content": "Rewrite this Python function with the variable `subtotal` renamed to "
               "`net_amount`. Change nothing else and output the whole function.\n\n" + FUNCTION}], {}),
    "quote": ([{"role": "user", "content": "Answer by quoting the context word for word.\n\nContext: " + CONTEXT
                + "\n\nQuestion: What happened in December 1993?"}], {}),
    "json": ([{"role": "user", "content": "Extract the order's fields as JSON.\n\n" + PARAGRAPH}],
             {"json_schema": SCHEMA}),
    "story": ([{"role": "user", "content": "Write a story about a lighthouse keeper who finds a message in a "
                "bottle."}], {}),
}
COPYING = ("summary", "code", "quote")


def one(llm: Any, task: str, tokens: int, speculate: Any) -> dict[str, Any]:
    prompt, extra = TASKS[task]
    return stream_once(llm, prompt, extra, tokens, speculate)


def stream_once(llm: Any, prompt: Any, extra: dict[str, Any], tokens: int, speculate: Any) -> dict[str, Any]:
    """One greedy stream: its text, tokens, decode tokens/s (after the first token), wall time and
    decode steps."""
    start = time.perf_counter()
    first = None
    final = None
    for ev in llm.stream(prompt, max_new_tokens=tokens, temperature=0.0, speculate=speculate, **extra):
        if first is None and ev.token_ids:
            first = time.perf_counter()
        final = ev
    end = time.perf_counter()
    assert final is not None and first is not None
    n = final.usage["completion_tokens"]
    return {"text": final.text, "tokens": n, "tok_s": (n - 1) / (end - first) if end > first else 0.0,
            "wall": end - start, "steps": final.metrics["decode_steps"]}


# A pause before each reading. llama.cpp's threads go on running for about 20 ms after it has
# answered (6-11 ms of CPU, measured from its process's schedstat): a reading of ours begun at once
# had its kernels' team preempted at its first barriers, and the team then ran on one thread for a
# spell (the story's first reading after llama.cpp's, in 2 rounds of 6: 2 stalled calls, 192 run
# alone, 65-70 tok/s against 84-105 for the others). That falls on whichever setting a round runs
# first. With the pause no reading of those 6 rounds stalled (docs/lookahead.md).
SETTLE_S = 0.05


def repeated(run: Callable[[], dict[str, Any]], min_decode: float) -> dict[str, Any]:
    """``run()`` (one stream's figures: ``tokens`` and ``tok_s``) called until its decodes add up to
    ``min_decode`` seconds: the first call's figures, with ``tok_s`` over all of them (tokens after
    each first token over the decode time). A 25-token answer decodes in about 0.15 s, where one
    burst of the host's noise moves a single reading by half (the quote at ``speculate=0``: 54 to 93
    tok/s over 8 runs of one process); summed over several it moves far less. Every setting, ours
    and llama.cpp's, is measured so, each until it has decoded that long, and each after `SETTLE_S`
    of quiet."""
    time.sleep(SETTLE_S)
    first = run()
    tokens, seconds, repeats = first["tokens"] - 1, decode_seconds(first), 1
    while seconds < min_decode:
        more = run()
        tokens, seconds, repeats = tokens + more["tokens"] - 1, seconds + decode_seconds(more), repeats + 1
    return {**first, "tok_s": tokens / seconds if seconds > 0 else 0.0, "repeats": repeats}


def contention() -> tuple[int, int]:
    """(kernel calls that stalled on a preempted teammate thread, calls then run on one thread) so far
    in this process (`NativeKernels.contention`; (0, 0) without the kernels): a sign that something
    else took the cores."""
    kernels = native_kernels()
    return kernels.contention() if kernels is not None else (0, 0)


def decode_seconds(figures: dict[str, Any]) -> float:
    """The time a stream took from its first token to its last (its tokens after the first over its rate)."""
    return float(figures["tokens"] - 1) / figures["tok_s"] if figures["tok_s"] > 0 else 0.0


LOOKUPS = (2, 4, 10)  # llama-cpp-python's num_pred_tokens tried (its default is 10)


class LlamaCpp:
    """llama.cpp in a process of its own, answering one request per call (`llama_cpp_stream.py
    --requests`); ``lookup``: prompt lookup decoding's draft length, 0 for none."""

    def __init__(self, lookup: int) -> None:
        import torch

        from multistream.text._loading import embedded_gguf_path

        script = Path(__file__).with_name("llama_cpp_stream.py")
        self.lookup = lookup
        self.child = subprocess.Popen(
            [sys.executable, str(script), str(embedded_gguf_path()), "--requests", str(torch.get_num_threads()),
             "--lookup", str(lookup)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.child.stdout is not None
        if not json.loads(self.child.stdout.readline() or "{}").get("ready"):
            raise RuntimeError("llama.cpp did not start (is llama-cpp-python installed?)")

    def run(self, llm: Any, task: str, tokens: int) -> dict[str, Any]:
        messages, extra = TASKS[task]
        text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert self.child.stdin is not None and self.child.stdout is not None
        self.child.stdin.write(json.dumps({"text": text, "n": tokens, "schema": extra.get("json_schema")}) + "\n")
        self.child.stdin.flush()
        return json.loads(self.child.stdout.readline())  # type: ignore[no-any-return]

    def close(self) -> None:
        self.child.kill()
        self.child.wait()


def llama_cpp_processes(lookups: tuple[int, ...]) -> dict[int, LlamaCpp]:
    """One llama.cpp process per configuration (0: plain, then each lookup length), or none when
    llama-cpp-python is missing."""
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp columns (pip install llama-cpp-python)")
        return {}
    print(f"llama-cpp-python {llama_cpp.__version__}", flush=True)
    return {k: LlamaCpp(k) for k in (0, *lookups)}


def batch(llm: Any, tokens: int, speculate: Any, streams: int = 8) -> dict[str, Any]:
    names = list(TASKS)
    out: list[dict[str, Any] | None] = [None] * streams
    go = threading.Barrier(streams + 1)

    def work(i: int) -> None:
        go.wait()
        out[i] = one(llm, names[i % len(names)], tokens, speculate)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    go.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done = [r for r in out if r is not None]
    return {"tok_s": sum(r["tokens"] for r in done) / wall, "texts": [r["text"] for r in done]}


def paired(ours: list[float], theirs: list[float]) -> float:
    """The median over rounds of our reading over theirs in the same round. The host's speed drifts
    within a run (the story at ``speculate=0`` read 92 tok/s in one round and 59 four rounds later,
    plain llama.cpp 80 and 67 in the same rounds), and two readings of one round share its speed,
    so their ratio does not drift; a ratio of the two medians can take them from different rounds.
    Example:
    ``paired([100, 60], [95, 55])`` is the median of 1.05 and 1.09."""
    return statistics.median(x / y for x, y in zip(ours, theirs, strict=True))


def in_order(round_: int) -> tuple[Any, ...]:
    """The two settings of a round, in the order that round runs them: the default first in even
    rounds, ``speculate=0`` first in odd ones, so whatever favours the first (or the second) run of a
    round favours neither setting (the default always went first, and the 8 streams' ratio was
    0.96x there against 0.99x in an alternating A/B)."""
    return ("auto", 0) if round_ % 2 == 0 else (0, "auto")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4,
                        help="interleaved rounds; an even number runs each setting first equally often")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--only", default=",".join(TASKS))
    parser.add_argument("--min-decode", type=float, default=0.5,
                        help="seconds of decoding each reading sums at least (a short answer is streamed again)")
    parser.add_argument("--no-batch", action="store_true")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--lookups", default=",".join(map(str, LOOKUPS)),
                        help="llama.cpp prompt lookup lengths to try ('' for plain llama.cpp only: "
                        "llama-cpp-python 0.3.36 crashes with a draft model)")
    args = parser.parse_args()
    lookups = tuple(int(k) for k in args.lookups.split(",") if k)
    llm = ms.load_text_model()
    cpp = {} if args.no_llama_cpp else llama_cpp_processes(lookups)
    print(f"load average before: {os.getloadavg()}", flush=True)
    one(llm, "story", 8, 0)  # warm-up
    for proc in cpp.values():
        proc.run(llm, "story", 8)
    results: dict[str, Any] = {}
    print("| task | default tok/s | speculate=0 tok/s | ratio | tokens/step | identical | llama.cpp tok/s "
          "| llama.cpp lookup tok/s (best K) | default / best lookup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for task in args.only.split(","):
        on, off = [], []
        theirs: dict[int, list[float]] = {k: [] for k in cpp}
        alone = {"auto": 0, 0: 0}  # kernel calls each setting ran on one thread after a stall (host contention)
        for round_ in range(args.rounds):  # interleaved rounds, the order alternating
            for speculate in in_order(round_):
                before = contention()[1]
                (on if speculate == "auto" else off).append(
                    repeated(partial(one, llm, task, args.tokens, speculate), args.min_decode))
                alone[speculate] += contention()[1] - before
            for k, proc in cpp.items():
                theirs[k].append(repeated(partial(proc.run, llm, task, args.tokens), args.min_decode)["tok_s"])
        ours = [r["tok_s"] for r in on]
        a, b = statistics.median(ours), statistics.median(r["tok_s"] for r in off)
        ratio = paired(ours, [r["tok_s"] for r in off])
        per_step = statistics.median(r["tokens"] / (r["steps"] + 1) for r in on)
        same = all(x["text"] == off[0]["text"] for x in on + off)
        results[task] = {"default_tok_s": a, "off_tok_s": b, "ratio": ratio, "ratio_of_medians": a / b,
                         "tokens_per_step": per_step, "identical": same, "tokens": on[0]["tokens"],
                         "solo_calls": {"default": alone["auto"], "off": alone[0]}}
        cells = "| - | - | -"
        if cpp:
            medians = {k: statistics.median(v) for k, v in theirs.items()}
            results[task].update({"llama_cpp_tok_s": medians[0], "llama_cpp_lookup_tok_s": medians})
            cells = f"| {medians[0]:.1f} | - | -"
            if lookups:
                best = max(lookups, key=lambda k: medians[k])
                versus = paired(ours, theirs[best])
                results[task].update({"best_lookup": best, "vs_best_lookup": versus,
                                      "vs_best_lookup_of_medians": a / medians[best]})
                cells = f"| {medians[0]:.1f} | {medians[best]:.1f} (K={best}) | {versus:.2f}x"
        print(f"| {task} | {a:.1f} | {b:.1f} | {ratio:.2f}x | {per_step:.2f} | {'yes' if same else 'NO'} {cells} |",
              flush=True)
    for proc in cpp.values():
        proc.close()
    if not args.no_batch:
        on_b, off_b = [], []
        for round_ in range(args.rounds):
            for speculate in in_order(round_):
                (on_b if speculate == "auto" else off_b).append(batch(llm, args.tokens, speculate))
        a, b = statistics.median(r["tok_s"] for r in on_b), statistics.median(r["tok_s"] for r in off_b)
        ratio = paired([r["tok_s"] for r in on_b], [r["tok_s"] for r in off_b])
        same = all(r["texts"] == off_b[0]["texts"] for r in on_b + off_b)
        results["8 streams"] = {"default_tok_s": a, "off_tok_s": b, "ratio": ratio, "ratio_of_medians": a / b,
                                "identical": same}
        print(f"| 8 streams (aggregate) | {a:.1f} | {b:.1f} | {ratio:.2f}x | - | {'yes' if same else 'NO'} "
              "| - | - | - |")
    print(f"load average after: {os.getloadavg()}")
    if native_kernels() is not None:
        stalled, solo = contention()
        by_task = ", ".join(f"{task} {r['solo_calls']['default']}/{r['solo_calls']['off']}"
                            for task, r in results.items() if "solo_calls" in r)
        print(f"kernel calls that stalled on a preempted thread: {stalled}; run on one thread after a stall: {solo} "
              f"(default/speculate=0 by task: {by_task}). Many means the host took the cores: rerun.")
        results["contention"] = {"stalled_calls": stalled, "solo_calls": solo}
    print(json.dumps(results))
    llm.close()


if __name__ == "__main__":
    main()
