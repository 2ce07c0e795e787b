"""``batchspec generate``: generate for a prompt file (the built-in set by default), in this process or on Ray Data
workers (``--ray``), and write one JSON line per prompt: to ``--out``, or to stdout (the summary then on stderr).

``--out`` is written to a new file in the same folder and renamed into place, so the file there is either this run's
whole output or, if writing fails (a full disk), the previous file unchanged. Ctrl-C during generation writes to
``--out`` a row for every prompt, in prompt order (the unfinished ones with ``"finish_reason": "interrupted"`` and
null outputs), says in one line how many are missing and exits with status 130; before generation starts (while the
models load) it writes nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from .common import (
    encode_prompts,
    engine_config,
    kv_memory_arg,
    model_args,
    non_negative_int,
    prefix_cache_arg,
    positive_int,
    prepare_out,
    read_prompt_set,
    rich_console,
    sampling_flags,
    write_atomic,
)

HELP = "generate for a prompt file"


def add_arguments(p) -> None:
    model_args(p)
    prefix_cache_arg(p)
    kv_memory_arg(p)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--layout", default="slotmask", choices=["slotmask", "eqspec"])
    p.add_argument("--scheduler", default="static", choices=["static", "continuous", "exspec"])
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy decoding")
    p.add_argument("--top-k", type=non_negative_int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0: off")
    p.add_argument("--seed", type=int, default=None, help="prompt i is sampled with seed + i")
    p.add_argument("--out", default=None, help="write one JSON line per prompt here (default: to stdout, and the "
                   "summary to stderr), in prompt order, whole or not at "
                   "all (a failed write keeps the previous file); after Ctrl-C the finished prompts, the others "
                   'marked finish_reason "interrupted". With --ray: a folder of files')
    p.add_argument("--ray", action="store_true", help="run on Ray Data workers, each holding the models (needs the "
                   "ray extra); prompts from --prompts (JSONL / Parquet, checked here, then read by Ray), files "
                   "written into --out")
    p.add_argument("--ray-address", default=None, help="with --ray: an existing cluster (auto or HOST:PORT); "
                   "default: start a local Ray")
    p.add_argument("--workers", type=positive_int, default=1, help="with --ray: model replicas (Ray actors)")
    p.add_argument("--cpus-per-worker", type=positive_int, default=1,
                   help="with --ray: CPU slots each worker takes, and its torch threads")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="with --ray: rows per worker call (default: the rows split evenly over the workers, <= 256)")
    p.add_argument("--out-format", default="jsonl", choices=["jsonl", "parquet"], help="with --ray: output files")


def run(args) -> int:
    import batchspec

    if args.ray:  # the same generation on Ray Data workers (batchspec.integrations.ray)
        return run_on_ray(args)
    sp = sampling_flags(args, max_tokens=args.max_tokens, seed=args.seed)
    pairs = read_prompt_set(args.prompts)
    out = prepare_out(args.out, folder=False) if args.out else None
    ids = [pid for pid, _ in pairs]
    try:
        llm = batchspec.LLM.from_config(engine_config(args))
        _, _, prompts = encode_prompts(pairs, llm.tokenizer, args.chat_template)
        if args.seed is not None:  # one seed for the run: prompt i gets seed + i
            sp = [dataclasses.replace(sp, seed=args.seed + i) for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, progress=True)
    except KeyboardInterrupt as e:  # Ctrl-C: keep what finished (exc.outputs: set once generation started)
        return interrupted(ids, getattr(e, "outputs", None), out)
    wall = time.perf_counter() - t0
    if out:
        write_rows(out, ids, outs)
    else:  # the outputs on stdout, as --out would have them; the summary on stderr
        sys.stdout.writelines(_line(pid, o) for pid, o in zip(ids, outs))
        sys.stdout.flush()
    s = llm.stats
    rich_console(stderr=out is None).print(
        f"{len(outs)} prompts, {s.generated} tokens in {wall:.1f} s: [bold]{s.generated / wall:.1f} tok/s[/bold], "
        f"mean accepted length {s.mean_accepted_length:.2f} (K={llm.k}, layout {args.layout}); "
        f"stage seconds prefill {s.prefill:.1f} draft {s.draft:.1f} verify {s.verify:.1f} align {s.align:.1f}"
        + (f"; wrote {out}" if out else "")
    )
    return 0


def interrupted(ids, outs, out) -> int:
    """After Ctrl-C: write a row for every prompt to ``out`` (the finished ones whole, the others marked
    ``interrupted``; ``outs`` None: generation had not started, nothing is written), say in one line how many are
    missing, and return the exit status 130 (128 + SIGINT)."""
    if outs is None:
        print("batchspec generate: interrupted before any prompt was generated; nothing written", file=sys.stderr)
        return 130
    done, n = sum(o is not None for o in outs), len(outs)
    if out is None:
        print(f"batchspec generate: interrupted: {done} of {n} prompts finished, {n - done} missing; nothing written "
              "(no --out)", file=sys.stderr)
        return 130
    write_rows(out, ids, outs)
    print(f"batchspec generate: interrupted: wrote {done} of {n} prompts to {out}; {n - done} missing (their rows "
          'have finish_reason "interrupted")', file=sys.stderr)
    return 130


def write_rows(out, ids, outs) -> None:
    """One JSON line per prompt, written whole or not at all (``write_atomic``); a Ctrl-C meanwhile is ignored, so
    that it cannot lose outputs already computed (only in the main thread, where Python handles signals)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        write_atomic(out, lambda f: f.writelines(_line(pid, o) for pid, o in zip(ids, outs)))
    finally:
        if main and previous is not None:
            signal.signal(signal.SIGINT, previous)


def _line(prompt_id, o) -> str:
    """The JSON line of one prompt; ``o`` None: not finished (Ctrl-C), its outputs null."""
    if o is None:
        return json.dumps({"prompt_id": prompt_id, "token_ids": None, "text": None, "finish_reason": "interrupted",
                           "num_rounds": None, "num_drafted": None, "num_accepted": None}) + "\n"
    return json.dumps({
        "prompt_id": prompt_id, "token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason,
        "num_rounds": o.num_rounds, "num_drafted": o.num_drafted, "num_accepted": o.num_accepted,
    }) + "\n"



def run_on_ray(args) -> int:
    """``batchspec generate --ray``: ``run`` with the command's flags, on a local Ray or the cluster at
    ``--ray-address``. Prompt files ending in .jsonl / .json / .ndjson / .parquet (or a folder of them) are read by Ray
    with any per-row sampling columns, after ``check_prompt_file`` has checked every row here; plain text files and
    the built-in set are read here first."""
    from ..integrations.ray import FORMATS, RayNotInstalled, check_prompt_file, require_ray, run
    from ..model.loading import resolve

    try:
        ray = require_ray()
    except RayNotInstalled as e:
        raise ValueError(str(e)) from None
    sp = sampling_flags(args, max_tokens=args.max_tokens)
    if not args.out:
        raise ValueError("--ray writes its files into a folder: give --out DIR")
    out = prepare_out(args.out, folder=True).resolve()
    if any(out.iterdir()):
        raise ValueError(f"--out {args.out} is not empty; give a new or empty folder")
    if args.prompts is not None and (Path(args.prompts).is_dir() or Path(args.prompts).suffix.lower() in FORMATS):
        if not Path(args.prompts).exists():
            raise FileNotFoundError(f"prompt file {args.prompts} does not exist")
        check_prompt_file(args.prompts, sp)  # every row, here: a bad one is one line naming it, before Ray starts
        source = os.path.abspath(args.prompts)  # workers need not share this process's working directory
    else:
        pairs = read_prompt_set(args.prompts)
        source = [{"id": i, "prompt_id": pid, "prompt": text} for i, (pid, text) in enumerate(pairs)]
    config = engine_config(args)
    draft = config.draft
    if args.ray_address is None:  # a local Ray: check the models (fetch or convert a built-in once) before workers
        resolve(args.target, "target")
        if isinstance(draft, str) and draft != "prompt-lookup":
            resolve(draft, "draft")
    gpus = 1 if (args.device or "").startswith("cuda") else 0
    started = not ray.is_initialized()
    if started:
        local = args.ray_address is None
        ray.init(address=args.ray_address, **({"include_dashboard": False} if local else {}))
        slots = ray.cluster_resources().get("CPU", 0)
        if local and args.workers * args.cpus_per_worker > slots:
            ray.shutdown()
            raise ValueError(f"--workers {args.workers} x --cpus-per-worker {args.cpus_per_worker} needs "
                             f"{args.workers * args.cpus_per_worker} CPU slots; this machine has {slots:g}")
    try:
        s = run(
            source, out, output_format=args.out_format, workers=args.workers, block_size=args.block_size,
            seed=args.seed, cpus_per_worker=args.cpus_per_worker, gpus_per_worker=gpus, config=config,
            chat_template=args.chat_template, sampling=sp,
        )
    finally:
        if started:
            ray.shutdown()
    rate = s["accepted"] / s["drafted"] if s["drafted"] else 0.0
    print(
        f"{s['rows']} prompts, {s['tokens']} tokens in {s['seconds']:.1f} s: {s['tokens'] / s['seconds']:.1f} tok/s "
        f"on {s['workers']} Ray worker{'s' if s['workers'] > 1 else ''} (block size {s['block_size']}), "
        f"draft acceptance {rate:.2f}; wrote {s['out']} ({s['format']})"
    )
    return 0
