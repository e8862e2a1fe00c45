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
    if not wants_help and not torch.cuda.is_available():
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
    except Exception:  # noqa: BLE001  (unreadable file: run_csa_layer raises the InputError)
        return []


def cmd_run(args: argparse.Namespace) -> int:
    from .pipeline import RATIO, InputError, run_layer
    args.device = _device(args.device)
    warning = ""
    if args.inputs:
        bad = _nonfinite_inputs(args.inputs)
        if bad:
            warning = (f"dsv4 run: WARNING: --inputs {args.inputs} contains non-finite values:\n  " + "\n  ".join(bad)
                       + "\n  The logits, the top-k selection and the recall / cosine numbers computed from them "
                         "are meaningless (a recall of 0.0000 or NaN is expected); fix the captured tensors.")
            print(warning, file=sys.stderr)
    try:
        out = run_layer(args)
    except InputError as e:
        print(f"dsv4 run: {e}", file=sys.stderr)
        return 2
    cfg = out.get("config", {}) if isinstance(out, dict) else {}
    k, n = cfg.get("topk"), cfg.get("entries")
    if cfg.get("layer", "csa") == "csa" and isinstance(k, int) and isinstance(n, int) and k >= n:
        print(f"note: top-{k} >= {n} compressed entries per sequence: every visible entry is selected, so the "
              f"top-k recall is trivially 1.0 and measures nothing (use a context longer than {RATIO} x {k} = "
              f"{RATIO * k} tokens, i.e. more than {k} compressed entries)")
    if warning:
        print("dsv4 run: WARNING: the inputs contain NaN/Inf values (see above): the quality numbers are meaningless",
              file=sys.stderr)
    return 0


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
                   help="context length in tokens per sequence, a multiple of 4 (default: 32768 on GPU, 8192 on CPU)")
    r.add_argument("--batch", type=int, default=None, help="decode batch size (default: 8 on GPU, 2 on CPU)")
    r.add_argument("--next-n", type=int, default=1, choices=(1, 2, 3, 4), help="queries per sequence (MTP)")
    r.add_argument("--format", choices=("mxfp4", "nvfp4", "fp8"), default="mxfp4",
                   help="indexer key format (CSA layers)")
    r.add_argument("--device", choices=DEVICES, default="auto",
                   help="where to run: cuda, cpu or auto (default: auto = cuda if a GPU is visible, else cpu)")
    r.add_argument("--seed", type=int, default=0, help="seed of the generated inputs (default: 0)")
    r.add_argument("--json", metavar="PATH", help="write the results as JSON")
    r.add_argument("--plot", metavar="PATH", help="write a PNG time-breakdown / roofline chart")
    r.add_argument("--inputs", metavar="PATH", help="safetensors file of captured CSA-layer tensors (q, K, w, kv)")
    r.add_argument("--no-progress", action="store_true", help="no progress bars")

    o = sub.add_parser("ops", help="registry table: op, providers, chosen, reason")
    o.add_argument("op", nargs="*")
    o.add_argument("--device", choices=DEVICES, default="auto",
                   help="target machine of the table: cuda, cpu or auto (default: auto)")
    o.add_argument("--json", action="store_true")

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
