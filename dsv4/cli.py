"""``dsv4`` command line (also ``python -m dsv4``).

Commands:
    dsv4 run       the main job: one DSV4 CSA layer's sparse path end to end (see dsv4/pipeline.py)
    dsv4 ops       the registry table for this machine (op, providers, chosen, reason)
    dsv4 layouts   the layout specs of each op's boundary (``--write DIR`` renders docs/layouts)
    dsv4 bench OP  runs ``bench/bench_<OP>.py`` with the remaining arguments
"""
from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _console():
    from rich.console import Console
    import shutil
    return Console(highlight=False, soft_wrap=False, width=shutil.get_terminal_size((150, 24)).columns)


def cmd_ops(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .registry import all_ops
    from .target import Target
    target = Target.of(args.device)
    t = Table(title=f"dsv4 ops on {target}", show_lines=False)
    for c in ("op", "provider", "can run", "chosen", "reason"):
        t.add_column(c, overflow="fold")
    rows = []
    for op in all_ops():
        if args.op and op.name not in args.op:
            continue
        for r in op.table(target):
            rows.append(r)
            t.add_row(r["op"], r["provider"], "yes" if r["ok"] else "no", "<--" if r["chosen"] else "", r["reason"])
    if args.json:
        import json
        print(json.dumps(rows, indent=1))
    else:
        _console().print(t)
        print("Override with DSV4_OPS=op=provider[,op=provider] (e.g. DSV4_OPS='*=torch').")
    return 0


def cmd_layouts(args: argparse.Namespace) -> int:
    from .layout import write_docs
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
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "bench"
    path = root / f"bench_{args.op}.py"
    if not path.exists():
        avail = sorted(p.stem[len("bench_"):] for p in root.glob("bench_*.py"))
        print(f"dsv4 bench: no benchmark for {args.op!r}; available: {', '.join(avail)}", file=sys.stderr)
        return 2
    import torch
    if not torch.cuda.is_available():
        print(f"dsv4 bench {args.op}: benchmarks time the GPU kernels and need a CUDA GPU (none is visible). "
              "On a CPU machine run `dsv4 run` (torch reference path) or the tests.", file=sys.stderr)
        return 2
    sys.argv = [str(path)] + rest
    runpy.run_path(str(path), run_name="__main__")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from .pipeline import InputError, run_csa_layer
    try:
        run_csa_layer(args)
    except InputError as e:
        print(f"dsv4 run: {e}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    p = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4 kernels for Hopper")
    p.add_argument("--version", action="version", version=f"dsv4-kernels {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="run one DSV4 CSA layer's sparse path end to end and print the stage table")
    r.add_argument("--model", choices=("flash", "pro"), default="flash",
                   help="DSV4-Flash (64 heads, top-512) or DSV4-Pro (128 heads, top-1024) shapes (default: flash)")
    r.add_argument("--context", type=int, default=None,
                   help="context length in tokens per sequence, a multiple of 4 (default: 32768 on GPU, 8192 on CPU)")
    r.add_argument("--batch", type=int, default=None, help="decode batch size (default: 8 on GPU, 2 on CPU)")
    r.add_argument("--next-n", type=int, default=1, choices=(1, 2, 3, 4), help="queries per sequence (MTP)")
    r.add_argument("--format", choices=("mxfp4", "nvfp4", "fp8"), default="mxfp4", help="indexer key format")
    r.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    r.add_argument("--seed", type=int, default=0, help="seed of the generated inputs (default: 0)")
    r.add_argument("--json", metavar="PATH", help="write the results as JSON")
    r.add_argument("--plot", metavar="PATH", help="write a PNG time-breakdown / roofline chart")
    r.add_argument("--inputs", metavar="PATH", help="safetensors file of captured tensors (q, K, w, kv)")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")

    o = sub.add_parser("ops", help="registry table: op, providers, chosen, reason")
    o.add_argument("op", nargs="*")
    o.add_argument("--device", default=None)
    o.add_argument("--json", action="store_true")

    l_ = sub.add_parser("layouts", help="print layout specs (or --write DIR / --check DIR for docs/layouts)")
    l_.add_argument("op", nargs="*")
    l_.add_argument("--write", metavar="DIR")
    l_.add_argument("--check", metavar="DIR")

    b = sub.add_parser("bench", help="run bench/bench_<OP>.py (extra arguments are passed through)")
    b.add_argument("op")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    if argv and argv[0] == "bench":
        args, rest = p.parse_known_args(argv)
        return cmd_bench(args, rest)
    args = p.parse_args(argv)
    return {"run": cmd_run, "ops": cmd_ops, "layouts": cmd_layouts}[args.cmd](args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
