"""``dsv4`` command line (also ``python -m dsv4``).

Commands:
    dsv4 run       the main job: one DSV4 layer's attention path end to end, --layer csa|hca|swa
                   (see dsv4/pipeline.py)
    dsv4 ops       the registry table for this machine (op, providers, chosen, reason)
    dsv4 layouts   the layout specs of each op's boundary (``--write DIR`` renders docs/layouts)
    dsv4 bench OP  runs ``bench/bench_<OP>.py`` with the remaining arguments
                   (``dsv4 bench --help`` lists them; ``dsv4 bench OP --help``: the benchmark's own options)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main"]

#: ``--device`` choices: ``auto`` = cuda if a GPU is visible, else cpu
DEVICES = ("auto", "cpu", "cuda")
_ROOT = Path(__file__).resolve().parents[1]
_BENCH_DIR = _ROOT / "bench"


def _device(arg: str | None) -> str | None:
    """``--device`` value -> torch device string, None for ``auto``."""
    return None if arg in (None, "auto") else arg


def _benchmarks() -> list[tuple[str, str]]:
    """(name, first docstring line) of each ``bench/bench_<name>.py``."""
    import ast
    out = []
    for p in sorted(_BENCH_DIR.glob("bench_*.py")):
        try:
            doc = ast.get_docstring(ast.parse(p.read_text())) or ""
        except (OSError, SyntaxError, ValueError):
            doc = ""
        out.append((p.stem[len("bench_"):], doc.strip().splitlines()[0] if doc.strip() else ""))
    return out


def _console():
    from rich.console import Console
    import shutil
    return Console(highlight=False, soft_wrap=False, width=shutil.get_terminal_size((150, 24)).columns)


def cmd_ops(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .registry import all_ops
    from .target import Target
    dev = _device(args.device)
    if dev == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("dsv4 ops: --device cuda: no CUDA device is visible (use --device cpu or auto)", file=sys.stderr)
            return 2
    target = Target.of(dev)
    ops = all_ops()
    unknown = [n for n in args.op if n not in {op.name for op in ops}]
    if unknown:
        print(f"dsv4 ops: unknown op {unknown[0]!r}; known: {', '.join(op.name for op in ops)}", file=sys.stderr)
        return 2
    from rich.markup import escape
    t = Table(title=f"dsv4 ops on {target}", show_lines=False)
    for c in ("op", "provider", "can run", "chosen", "reason"):
        t.add_column(c, overflow="fold")
    rows = []
    try:
        for op in ops:
            if args.op and op.name not in args.op:
                continue
            for r in op.table(target):
                rows.append(r)
                why = r["reason"] if r["implemented"] else "not implemented for this op"
                t.add_row(r["op"], r["provider"], "yes" if r["ok"] else "no", "<--" if r["chosen"] else "",
                          escape(why))   # reasons are plain text (e.g. "pip install -e '.[cu13]'"), not rich markup
    except ValueError as e:                  # a bad DSV4_OPS value (unknown op or provider)
        print(f"dsv4 ops: {e}", file=sys.stderr)
        return 2
    if args.json:
        import json
        print(json.dumps(rows, indent=1))
    else:
        _console().print(t)
        if args.verbose:
            for r in rows:
                if r["chosen"]:
                    print(f"{r['op']}: {r['explain']}")
        print("Override with DSV4_OPS=op=provider[,op=provider] (e.g. DSV4_OPS='*=torch').")
    return 0


def cmd_layouts(args: argparse.Namespace) -> int:
    from .layout_docs import write_docs
    from .registry import all_ops, get_op
    if args.write or args.check:
        d = args.write or args.check
        stale = write_docs(d, check=bool(args.check))
        if args.check:
            if stale:
                print("out of date: " + ", ".join(stale) + f"\nrun: python -m dsv4 layouts --write {d}")
                return 1
            print(f"{d}: up to date")
        else:
            print(f"wrote {len(stale)} file(s) under {d}" + ("" if stale else " (already up to date)"))
        return 0
    try:
        ops = [get_op(n) for n in args.op] if args.op else all_ops()
    except KeyError as e:
        print(f"dsv4 layouts: {e.args[0]}", file=sys.stderr)
        return 2
    for op in ops:
        print(op.spec.text())
        print()
    return 0


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    import runpy
    path = _BENCH_DIR / f"bench_{args.op}.py"
    if not path.exists():
        avail = [n for n, _ in _benchmarks()]
        print(f"dsv4 bench: no benchmark for {args.op!r}; available: {', '.join(avail)} "
              f"(dsv4 bench --help describes them)", file=sys.stderr)
        return 2
    import torch
    wants_help = any(a in ("-h", "--help") for a in rest)
    if str(_ROOT) not in sys.path:          # the bench scripts import bench._util
        sys.path.insert(0, str(_ROOT))
    cpu_ok = "\nCPU_OK = True" in path.read_text()       # a benchmark that also measures on CPU (bench_eager)
    if not wants_help and not cpu_ok and not torch.cuda.is_available():
        print(f"dsv4 bench {args.op}: benchmarks time the GPU kernels and need a CUDA GPU (none is visible). "
              "On a CPU machine run `dsv4 run` (torch reference path) or the tests.", file=sys.stderr)
        return 2
    sys.argv = [str(path)] + rest
    runpy.run_path(str(path), run_name="__main__")
    return 0


def _nonfinite_inputs(path: str) -> list[str]:
    """One line per floating tensor of the ``--inputs`` file holding NaN / Inf values (empty if
    none, or if the file cannot be read: the pipeline then reports that)."""
    try:
        import torch
        from safetensors import safe_open
        bad = []
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if t.is_floating_point() and t.numel():
                    n = int((~torch.isfinite(t)).sum())
                    if n:
                        bad.append(f"'{key}' {list(t.shape)}: {n} of {t.numel()} values are NaN/Inf "
                                   f"({int(torch.isnan(t).sum())} NaN)")
        return bad
    except Exception:  # noqa: BLE001  (unreadable file: plan_layer raises the InputError)
        return []


#: ``--plot`` extensions matplotlib writes
PLOT_EXTENSIONS = (".png", ".svg", ".pdf")


def _output_problem(path: str | None, flag: str, exts: tuple[str, ...]) -> str | None:
    """Why ``path`` cannot be written (checked before the run), or None."""
    import os
    if not path:
        return None
    if not path.lower().endswith(exts):
        return f"{flag} {path}: the file name must end in {' / '.join(exts)}"
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{flag} {path}: is a directory"
    if not os.path.isdir(d):
        return f"{flag} {path}: directory {d} does not exist"
    if not os.access(d, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{flag} {path}: not writable"
    return None


def cmd_run(args: argparse.Namespace) -> int:
    from .pipeline import RATIO, InputError, LayerConfig, plan_layer, run_plan
    for problem in (_output_problem(args.json, "--json", (".json",)),
                    _output_problem(args.plot, "--plot", PLOT_EXTENSIONS)):
        if problem:
            print(f"dsv4 run: {problem}", file=sys.stderr)
            return 2
    warning = ""
    if args.inputs:
        given = [f"{f} {v}" for f, v in (("--context", args.context), ("--batch", args.batch),
                                          ("--next-n", args.next_n if args.next_n != 1 else None)) if v is not None]
        if given:
            print(f"dsv4 run: note: --inputs sets the batch, context and next_n from the file; "
                  f"{', '.join(given)} ignored", file=sys.stderr)
        bad = _nonfinite_inputs(args.inputs)
        if bad:
            warning = (f"dsv4 run: WARNING: --inputs {args.inputs} contains non-finite values:\n  " + "\n  ".join(bad)
                       + "\n  The logits, the top-k selection and the recall / cosine numbers computed from them "
                         "are meaningless (a recall of 0.0000 or NaN is expected); fix the captured tensors.")
            print(warning, file=sys.stderr)
    cfg = LayerConfig(model=args.model, layer=args.layer, context=args.context, batch=args.batch, next_n=args.next_n,
                      fmt=args.format, device=_device(args.device), seed=args.seed, inputs=args.inputs)
    progress = not args.no_progress and sys.stderr.isatty()
    try:
        plan = plan_layer(cfg, progress=progress)
    except InputError as e:
        print(f"dsv4 run: {e}", file=sys.stderr)
        return 2
    print(plan.banner)
    if plan.sizes.device.type != "cuda":
        defaults = args.context is None and args.batch is None and not args.inputs
        print("No GPU: running the torch REFERENCE path of every op" + (" (small default size)" if defaults else "")
              + "; the kernels run on a Hopper GPU.")
    res = run_plan(plan, progress=progress)
    _print_result(res)
    cfg_out = res.config
    k, n = cfg_out.get("topk"), cfg_out.get("entries")
    if cfg_out.get("layer", "csa") == "csa" and isinstance(k, int) and isinstance(n, int) and k >= n:
        print(f"note: top-{k} >= {n} compressed entries per sequence: every visible entry is selected, so the "
              f"top-k recall is trivially 1.0 and measures nothing (use a context longer than {RATIO} x {k} = "
              f"{RATIO * k} tokens, i.e. more than {k} compressed entries)")
    if args.json:
        import json

        from .measure import json_safe
        with open(args.json, "w") as f:
            json.dump(json_safe(res.to_json()), f, indent=1, default=str, allow_nan=False)
        print(f"wrote {args.json}")
    if args.plot:
        plot_result(res, args.plot)
        print(f"wrote {args.plot}")
    if warning:
        print("dsv4 run: WARNING: the inputs contain NaN/Inf values (see above): the quality numbers are meaningless",
              file=sys.stderr)
    return 0


def _g3(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _print_result(res) -> None:
    """The stage table (time, bandwidth, FLOP rate, % of roofline, which provider ran and why)
    and the quality line."""
    import math
    import shutil

    from rich.markup import escape
    from rich.table import Table

    from .measure import BF16_PEAK_TFLOPS
    width = shutil.get_terminal_size((150, 24)).columns
    wide = width >= 140                      # narrow terminals: reasons go below the table
    bw, on_gpu, quality = res.copy_bandwidth_gbps, res.on_gpu, res.quality
    t = Table(title=f"stages (copy bandwidth {bw:.0f} GB/s" + (f", BF16 peak {BF16_PEAK_TFLOPS:.0f} TFLOP/s)"
                                                              if on_gpu else ", CPU)"))
    cols = [("stage", "left", 20), ("provider", "left", 8), ("time", "right", 11), ("GB/s", "right", 6),
            ("TFLOP/s", "right", 7), ("% roofline", "right", 10)] + ([("why this provider", "left", 20)] if wide else [])
    for c, j, w in cols:
        t.add_column(c, justify=j, overflow="fold", min_width=w, no_wrap=(c != "why this provider"))
    for r in res.stages:
        row = [r.name, r.provider, f"{r.time_us:,.1f} us" + (" (eager)" if r.timing == "eager" else ""), _g3(r.gbps),
               "-" if math.isnan(r.tflops) else f"{r.tflops:.1f}",
               f"{r.pct_roofline:.1f}% {'BW' if r.roofline == 'bw' else 'BF16'}" if on_gpu else "n/a (CPU)"]
        t.add_row(*(row + ([escape(r.reason)] if wide else [])))
    c = _console()
    c.print(t)
    if not wide:
        for r in res.stages:
            c.print(f"  {r.name}: {escape(r.reason)}")
    if on_gpu:
        c.print("times: median of CUDA-graph replays (kernel time without Python/launch overhead); "
                "roofline = bytes / measured copy bandwidth, or FLOPs / BF16 peak for the attention stage")
    else:
        c.print("times: CPU wall clock of the torch reference (mean of the repetitions); the roofline columns "
                "are only meaningful on a GPU")
    rec = "" if quality["topk_recall_mean"] is None else (
        f"top-k recall mean {quality['topk_recall_mean']:.4f} (min {quality['topk_recall_min']:.4f}); ")
    same = "" if quality.get("attn_cosine_same_lists_mean") is None else (
        f"; same lists {quality['attn_cosine_same_lists_mean']:.6f} (min {quality['attn_cosine_same_lists_min']:.6f})")
    c.print(f"quality vs FP32 path: {rec}attention output cosine mean "
            f"{quality['attn_cosine_mean']:.6f} (min {quality['attn_cosine_min']:.6f}){same}")


def _time_label(us: float) -> str:
    return f"{us / 1e3:,.2f} ms" if us >= 1e4 else f"{us:,.1f} us"


def plot_result(res, path: str) -> None:
    """Time per stage (log axis, every bar labelled with its value and provider) and % of the
    roofline (labelled; on a CPU run the panel says that no roofline applies)."""
    import math

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    stages = res.stages
    names = [r.name for r in stages]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 0.55 * len(stages) + 2.2))
    times = [max(r.time_us, 1e-3) for r in stages]
    bars = a1.barh(names, times, color="tab:blue")
    a1.set_xscale("log")
    a1.set_xlim(min(times) / 3, max(times) * 40)          # room for the labels right of the bars
    a1.bar_label(bars, labels=[f"{_time_label(r.time_us)}  {r.provider}" for r in stages], padding=3, fontsize=8)
    a1.set_xlabel("time per call, us (log scale)")
    a1.set_title("time per stage" + (" (CUDA-graph replays)" if res.on_gpu else " (CPU wall clock, torch reference)"))
    a1.invert_yaxis()
    pct = [0.0 if math.isnan(r.pct_roofline) else r.pct_roofline for r in stages]
    a2.set_title("% of roofline")
    a2.set_yticks(range(len(names)), names)
    a2.set_ylim(len(names) - 0.5, -0.5)                  # same rows as the time panel, top to bottom
    if res.on_gpu:
        b2 = a2.barh(range(len(names)), pct, color="tab:green")
        a2.bar_label(b2, labels=[f"{p:.1f}% {'BW' if r.roofline == 'bw' else 'BF16'}" for p, r in zip(pct, stages)],
                     padding=3, fontsize=8)
        a2.set_xlim(0, max(110.0, max(pct) * 1.2))
        a2.set_xlabel("% of roofline (bytes / copy bandwidth, or FLOPs / BF16 peak for attention)")
    else:
        a2.set_xlim(0, 100)
        a2.text(50, (len(names) - 1) / 2, "no roofline on a CPU run:\nthe torch reference ran, not the kernels\n"
                "(run on a Hopper GPU for % of copy bandwidth / BF16 peak)", ha="center", va="center", fontsize=10,
                color="0.35", bbox=dict(boxstyle="round", fc="0.95", ec="0.7"))
        a2.set_xlabel("% of roofline: not applicable (CPU)")
    fig.suptitle(res.banner + ("" if res.on_gpu else " [torch reference path, CPU]"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    p = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4 kernels for Hopper")
    p.add_argument("--version", action="version", version=f"dsv4-kernels {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="run one DSV4 layer's attention path end to end and print the stage table")
    r.add_argument("--layer", choices=("csa", "hca", "swa"), default="csa",
                   help="csa: indexer + top-k + sparse attention (ratio 4); hca: compressor + attention over every "
                        "compressed entry (ratio 128); swa: sliding window only (default: csa)")
    r.add_argument("--model", choices=("flash", "pro"), default="flash",
                   help="DSV4-Flash (64 heads, top-512) or DSV4-Pro (128 heads, top-1024) shapes (default: flash)")
    r.add_argument("--context", type=int, default=None,
                   help="context length in tokens per sequence, a multiple of 4 and >= 256 (default: 32768 on GPU, "
                        "8192 on CPU; with --inputs: from the file)")
    r.add_argument("--batch", type=int, default=None,
                   help="decode batch size, >= 1 (default: 8 on GPU, 2 on CPU; with --inputs: from the file)")
    r.add_argument("--next-n", type=int, default=1, choices=(1, 2, 3, 4), help="queries per sequence (MTP)")
    r.add_argument("--format", choices=("mxfp4", "nvfp4", "fp8"), default="mxfp4",
                   help="indexer key format (CSA layers)")
    r.add_argument("--device", choices=DEVICES, default="auto",
                   help="where to run: cuda, cpu or auto (default: auto = cuda if a GPU is visible, else cpu)")
    r.add_argument("--seed", type=int, default=0, help="seed of the generated inputs (default: 0)")
    r.add_argument("--json", metavar="PATH", help="write the results as JSON (PATH ends in .json; checked before the run)")
    r.add_argument("--plot", metavar="PATH", help="write a time-breakdown / roofline chart (PATH ends in .png, .svg or "
                                                  ".pdf; checked before the run)")
    r.add_argument("--inputs", metavar="PATH", help="safetensors file of captured CSA-layer tensors (q, K, w, kv)")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")

    o = sub.add_parser("ops", help="registry table: op, providers, chosen, reason")
    o.add_argument("op", nargs="*")
    o.add_argument("--device", choices=DEVICES, default="auto",
                   help="target machine of the table: cuda, cpu or auto (default: auto)")
    o.add_argument("--json", action="store_true")
    o.add_argument("--verbose", "-v", action="store_true",
                   help="also print, per op, every provider considered, the choice and its tunables (config)")

    l_ = sub.add_parser("layouts", help="print layout specs (or --write DIR / --check DIR for docs/layouts)")
    l_.add_argument("op", nargs="*")
    l_.add_argument("--write", metavar="DIR")
    l_.add_argument("--check", metavar="DIR")

    benches = _benchmarks()
    width = max([len(n) for n, _ in benches] + [4])
    listing = "\n".join(f"  {n:<{width}}  {d}" for n, d in benches) or "  (none found under bench/)"
    b = sub.add_parser("bench", help="run bench/bench_<OP>.py (extra arguments are passed through)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Run a GPU benchmark, bench/bench_<OP>.py, passing the remaining arguments "
                                   "through (needs a CUDA GPU).",
                       epilog="available benchmarks (OP):\n" + listing + "\n\n"
                              "A benchmark's own options: dsv4 bench OP --help (e.g. dsv4 bench topk --help; works "
                              "without a GPU).\nExample: dsv4 bench topk --json out/topk.json")
    b.add_argument("op", metavar="OP", help="benchmark name: " + ", ".join(n for n, _ in benches))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    if argv and argv[0] == "bench":
        if len(argv) >= 2 and not argv[1].startswith("-"):
            # everything after OP belongs to the benchmark (including its own --help)
            return cmd_bench(argparse.Namespace(cmd="bench", op=argv[1]), argv[2:])
        p.parse_args(argv)            # `dsv4 bench --help` / missing OP: argparse prints and exits
        return 2
    args = p.parse_args(argv)
    return {"run": cmd_run, "ops": cmd_ops, "layouts": cmd_layouts}[args.cmd](args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
