"""The ``moe-registry`` command line. Errors on bad input print one line and exit 2; no traceback."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moe_registry.errors import MoERegistryError, SelectionError
from moe_registry.explain import Flags, situation_for
from moe_registry.registry import load_registry, validate_paths


def _add_runtime_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--platform", help="cpu, cuda:9.0, rocm:9.4, xpu or auto (this machine; default)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="activation dtype")
    p.add_argument("--tp", type=int, help="tensor-parallel size")
    p.add_argument("--ep", type=int, help="expert-parallel size")
    p.add_argument("--dp", type=int, help="data-parallel size")
    p.add_argument("--all2all", help="all2all backend for EP: none, naive, pplx, deepep_low_latency, ...")
    p.add_argument("--layer", type=int, help="decoder layer (default: the first MoE layer)")
    p.add_argument("--max-tokens", type=int, dest="max_tokens", help="token budget per forward")
    p.add_argument("--spec-dir", action="append", default=[], help="extra spec dir (repeatable); "
                   "also MOE_REGISTRY_SPEC_PATH")


def _flags(args: argparse.Namespace) -> Flags:
    return Flags(args.platform, args.dtype, args.tp, args.ep, args.dp, args.all2all, args.layer, args.max_tokens)


def cmd_explain(args: argparse.Namespace) -> int:
    from moe_registry.oracle import select

    registry = load_registry(args.spec_dir)
    situation = situation_for(Path(args.target), registry, _flags(args))
    try:
        report = select(registry, situation, prefer=args.prefer, pin=args.kernel)
    except SelectionError as err:
        if err.report is not None:
            _print_report(err.report, args)
        print(f"error: {err}", file=sys.stderr)
        return 1
    _print_report(report, args)
    return 0


def _print_report(report: object, args: argparse.Namespace) -> None:
    if args.json:
        print(report.to_json())  # type: ignore[attr-defined]
    elif args.markdown:
        print(report.to_markdown())  # type: ignore[attr-defined]
    else:
        print(report.to_text())  # type: ignore[attr-defined]


def cmd_list(args: argparse.Namespace) -> int:
    registry = load_registry(args.spec_dir)
    if args.what == "schemes":
        rows = [{"scheme": n, "summary": s.spec.summary, "kernels": s.spec.kernels, "path": s.path}
                for n, s in sorted(registry.schemes.items())]
    elif args.what == "kernels":
        rows = [{"kernel": n, "summary": k.spec.summary, "platforms": [
            p.device + (f" {p.capability}" if p.capability else "") for p in k.spec.platforms], "path": k.path}
            for n, k in sorted(registry.kernels.items())]
    else:
        rows = [{"family": n, "summary": f.spec.summary, "model_types": f.spec.match.model_type, "path": f.path}
                for n, f in sorted(registry.families.items())]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    key = next(iter(rows[0])) if rows else "name"
    width = max((len(str(r[key])) for r in rows), default=4)
    for r in rows:
        print(f"{str(r[key]).ljust(width)}  {r['summary']}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from moe_registry.conformance import undeclarable_options

    problems = [str(p) for p in validate_paths(args.paths)]
    if not problems:
        registry = load_registry([p for p in args.paths if Path(p).is_dir()])
        problems += undeclarable_options(registry)
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("all specs valid")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from moe_registry.spec_models import SPEC_KINDS

    kinds = [args.kind] if args.kind else list(SPEC_KINDS)
    out = {k: SPEC_KINDS[k].model_json_schema(by_alias=True) for k in kinds}
    print(json.dumps(out[args.kind] if args.kind else out, indent=2))
    return 0


def cmd_matrix(args: argparse.Namespace) -> int:
    from moe_registry.matrix import matrix_markdown, support_matrix

    registry = load_registry(args.spec_dir)
    if args.json:
        print(json.dumps(support_matrix(registry), indent=2))
    else:
        print(matrix_markdown(registry), end="")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from moe_registry.run import run_layer_command

    return run_layer_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-registry", description="Declarative quantized-MoE kernel registry")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("explain", help="which scheme and kernel a model would use here, and why")
    p.add_argument("target", help="config.json, a model dir, or a runtime YAML/JSON file")
    _add_runtime_flags(p)
    p.add_argument("--kernel", help="pin this kernel (fail if it cannot run)")
    p.add_argument("--prefer", help="prefer this kernel (fall back if it cannot run)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument("--markdown", action="store_true")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("list", help="list schemes, kernels or model families")
    p.add_argument("what", choices=["schemes", "kernels", "families"])
    p.add_argument("--json", action="store_true")
    p.add_argument("--spec-dir", action="append", default=[])
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("validate", help="validate spec files (default: the built-ins)")
    p.add_argument("paths", nargs="*")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("schema", help="JSON Schema of each spec kind, for editors")
    p.add_argument("kind", nargs="?", choices=["scheme", "kernel", "family"])
    p.set_defaults(func=cmd_schema)

    p = sub.add_parser("matrix", help="support matrix scheme x platform x kernel")
    p.add_argument("--json", action="store_true")
    p.add_argument("--spec-dir", action="append", default=[])
    p.set_defaults(func=cmd_matrix)

    p = sub.add_parser("run", help="load one MoE layer of a checkpoint, run it and compare with float64")
    p.add_argument("target", help="model dir (config.json + safetensors)")
    _add_runtime_flags(p)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--kernel", help="pin this kernel")
    p.add_argument("--prefer", help="prefer this kernel")
    p.add_argument("--inputs", help="safetensors file with hidden_states (and optionally topk_ids/topk_weights)")
    p.add_argument("--save-output", dest="save_output", help="write the layer output to this safetensors file")
    p.add_argument("--repeat", type=int, default=5, help="timed calls")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except MoERegistryError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `moe-registry schema | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
