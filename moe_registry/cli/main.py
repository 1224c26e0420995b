"""The ``moe-registry`` command line.

Exit codes, the same in every verb (docs/cli.md, "Exit codes"):

  0  ok
  1  refused: no scheme matches, no kernel can run it, the pinned kernel cannot; or ``run``'s
     output is out of the scheme's tolerance
  2  bad input: a bad file, flag value or name (argparse usage errors included)
  3  internal error: a bug; one line ``internal error: ...`` (``MOE_REGISTRY_DEBUG=1`` re-raises it)
  130  interrupted

Errors are one line on stderr, never a traceback; under ``--json`` they are one JSON object on
stdout instead: ``{"error": "...", "exit_code": N}`` (a refused ``explain``/``run`` adds ``report``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from moe_registry.cli.generate import add_generate_parser
from moe_registry.core import guards
from moe_registry.core.errors import ConfigError, MoERegistryError, SelectionError
from moe_registry.core.names import did_you_mean
from moe_registry.core.vocab import ALL2ALL_BACKENDS, ALL2ALL_IMPLEMENTED, EXPERT_PLACEMENTS
from moe_registry.situation.describe import Flags, check_kernel_names, situation_for
from moe_registry.spec.loader import load_registry

EXIT_OK, EXIT_REFUSED, EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
KIND_WORDS = {"scheme": "scheme", "schemes": "scheme", "kernel": "kernel", "kernels": "kernel",
              "family": "family", "families": "family"}
_json_errors = False  # set by main() from argv: usage errors are JSON too under --json


def emit_error(message: str, code: int, extra: dict[str, Any] | None = None, prefix: str = "error: ") -> int:
    """Print one error (JSON on stdout under --json, else one line on stderr) and return its code."""
    if _json_errors:
        print(json.dumps({"error": message, "exit_code": code, **(extra or {})}))
    else:
        print(f"{prefix}{message}", file=sys.stderr)
    return code


class Parser(argparse.ArgumentParser):
    """argparse with "did you mean" for unknown verbs, choices and flags, and JSON usage errors."""

    subparsers_by_name: dict[str, Parser]

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            verb = getattr(self, "subparsers_by_name", {}).get(getattr(ns, "command", None) or "", self)
            verb.error("unrecognized arguments: " + " ".join(extras))
        return ns

    def _suggest(self, message: str) -> str:
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m:
            return did_you_mean(m.group(1), re.findall(r"'([^']*)'", m.group(2)) or m.group(2).split(", "))
        if message.startswith("unrecognized arguments: "):
            options = [o for o in self._option_string_actions if o.startswith("--")]
            hints = [did_you_mean(t.split("=")[0], options) for t in message.split()[2:] if t.startswith("-")]
            return next((h for h in hints if h), "")
        return ""

    def error(self, message: str) -> NoReturn:
        message += self._suggest(message)
        if _json_errors:
            print(json.dumps({"error": f"{self.prog}: {message}", "exit_code": EXIT_BAD_INPUT}))
        else:
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def _kind_word(text: str) -> str:
    return KIND_WORDS.get(text.lower(), text)


# ---------------------------------------------------------------- verbs


def _flags(args: argparse.Namespace) -> Flags:
    return Flags(args.platform, args.dtype, args.tp, args.ep, args.dp, args.all2all, args.layer, args.max_tokens,
                 args.expert_placement)


def cmd_explain(args: argparse.Namespace) -> int:
    from moe_registry.oracle.select import select_model

    registry = load_registry(args.spec_dir)
    check_kernel_names(registry, kernel=args.kernel, prefer=args.prefer)
    situation = situation_for(Path(args.target), registry, _flags(args))
    report = select_model(registry, situation, prefer=args.prefer, pin=args.kernel)
    print_report(report, args)
    return EXIT_OK


def print_report(report: Any, args: argparse.Namespace) -> None:
    """The report in the format the flags ask for."""
    verbose = getattr(args, "verbose", False)
    if args.json:
        print(report.to_json(verbose))
    elif getattr(args, "markdown", False):
        print(report.to_markdown(verbose))
    else:
        print(report.to_text(verbose))


def cmd_list(args: argparse.Namespace) -> int:
    registry = load_registry(args.spec_dir)
    if args.what == "scheme":
        rows = [{"scheme": n, "summary": s.spec.summary, "kernels": s.spec.kernels, "path": s.path}
                for n, s in sorted(registry.schemes.items())]
    elif args.what == "kernel":
        rows = [{"kernel": n, "summary": k.spec.summary, "platforms": [
            p.device + (f" {p.capability}" if p.capability else "") for p in k.spec.platforms], "path": k.path}
            for n, k in sorted(registry.kernels.items())]
    else:
        rows = [{"family": n, "summary": f.spec.summary, "model_types": f.spec.match.model_type, "path": f.path}
                for n, f in sorted(registry.families.items())]
    if args.json:
        print(json.dumps(rows))
        return EXIT_OK
    key = next(iter(rows[0])) if rows else "name"
    width = max((len(str(r[key])) for r in rows), default=4)
    for r in rows:
        print(f"{str(r[key]).ljust(width)}  {r['summary']}")
    return EXIT_OK


def cmd_validate(args: argparse.Namespace) -> int:
    from moe_registry.spec.loader import files_to_validate
    from moe_registry.testing.conformance import undeclarable_options

    files, empty = files_to_validate(args.paths)
    problems: list[dict[str, Any]] = []
    from moe_registry.spec.validation import validate_paths

    for p in validate_paths(args.paths):
        problems.append({"text": str(p), "path": p.path, "line": p.line, "field": p.field, "message": p.message})
    problems += [{"text": f"validate: no spec files found in {d}", "path": str(d), "line": None, "field": None,
                  "message": "no spec files found (wanted *.yaml in it or in its schemes/, kernels/, models/)"}
                 for d in empty]
    if not problems:
        registry = load_registry([p for p in args.paths if Path(p).is_dir()])
        problems += [{"text": t, "path": None, "line": None, "field": None, "message": t}
                     for t in undeclarable_options(registry)]
    problems = list({p["text"]: p for p in problems}.values())  # each problem once
    n = len(files)
    what = f"{n} file{'' if n == 1 else 's'}" + ("" if args.paths else " (the built-in specs)")
    if problems:
        summary = f"{len(problems)} problem{'' if len(problems) == 1 else 's'} in {what}"
        if not files:  # only empty dirs: their lines say it all
            summary = "; ".join(p["text"] for p in problems)
        if args.json:
            return emit_error(summary, EXIT_BAD_INPUT, {"files": n, "problems": problems})
        for p in problems if files else ():
            print(p["text"])
        print(summary)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps({"files": n, "problems": []}))
    else:
        print(f"{what}, all valid")
    return EXIT_OK


def editor_schema() -> dict[str, Any]:
    """One JSON Schema for any spec file: ``oneOf`` the kinds, their models under ``$defs``."""
    from moe_registry.spec.models import SPEC_KINDS

    defs: dict[str, Any] = {}
    refs = []
    for model in SPEC_KINDS.values():
        body = model.model_json_schema(by_alias=True)
        for name, sub in body.pop("$defs", {}).items():
            assert defs.get(name, sub) == sub, f"two different $defs named {name}"
            defs[name] = sub
        defs[body["title"]] = body
        refs.append({"$ref": f"#/$defs/{body['title']}"})
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "moe-registry spec",
            "description": "A scheme, kernel, model-family or checkpoint-format spec (exactly one of the keys "
                           + ", ".join(SPEC_KINDS) + ").",
            "oneOf": refs, "$defs": defs}


def cmd_schema(args: argparse.Namespace) -> int:
    from moe_registry.spec.models import SPEC_KINDS

    schema = SPEC_KINDS[args.kind].model_json_schema(by_alias=True) if args.kind else editor_schema()
    print(json.dumps(schema, indent=None if args.json else 2))
    return EXIT_OK


def cmd_matrix(args: argparse.Namespace) -> int:
    from moe_registry.cli.matrix import matrix_markdown, support_matrix

    registry = load_registry(args.spec_dir)
    if args.json:
        print(json.dumps(support_matrix(registry)))
    else:
        print(matrix_markdown(registry), end="")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    """One process, or, started by torchrun with several ranks (or with --ep above 1), this rank's part."""
    from moe_registry.cli.run_checks import check_before_torch, check_common_flags, started_by_torchrun

    if started_by_torchrun():  # what needs no torch is refused before torch is imported (a second or more)
        check_common_flags(args)
    else:
        check_before_torch(args)
    from moe_registry.cli.run import run_layer_command
    from moe_registry.cli.run_ep import run_ep_command, torchrun_env

    env = torchrun_env()
    if env is not None and (env.world_size > 1 or (args.ep or 1) > 1):
        return run_ep_command(args, env)
    return run_layer_command(args)


# ---------------------------------------------------------------- parser

EXAMPLE_CONFIG = "examples/mixtral-8x7b-awq/config.json"
EXAMPLE_MODEL = "examples/checkpoints/mixtral-awq"
EXIT_CODES = """exit codes: 0 ok; 1 refused (no scheme/kernel can run it, pinned kernel rejected) or out of
tolerance; 2 bad input (file, flag value, unknown name); 3 internal error. Under --json every error
is one JSON object on stdout: {"error": "...", "exit_code": N}."""


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines) + "\n\n" + EXIT_CODES


def _add(parser: Parser, sub: Any, name: str, help: str, examples: tuple[str, ...]) -> Parser:
    p: Parser = sub.add_parser(name, help=help, description=help[:1].upper() + help[1:] + ".",
                               epilog=_examples(*examples), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.subparsers_by_name[name] = p  # so an unknown flag is reported by its verb's parser
    return p


def _add_json(p: argparse.ArgumentParser, what: str = "the result") -> None:
    p.add_argument("--json", action="store_true",
                   help=f"print {what} as compact JSON on stdout (errors too: {{\"error\", \"exit_code\"}})")


def _add_spec_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec-dir", action="append", default=[], metavar="DIR",
                   help="extra spec dir, adding or overriding specs by name (repeatable; also the "
                        "MOE_REGISTRY_SPEC_PATH variable), e.g. --spec-dir my-specs/")


SIZE_MOST = 1 << 40  # --tp, --ep, --dp, --max-tokens: the upper bound only stops absurd sizes
POSITIVE = "a positive integer"


def _count(flag: str, most: int, below: str = "at least 1") -> Callable[[str], int]:
    """An argparse type for a count flag: an integer from 1 to ``most``, refused (one line, exit 2) while the
    command line is parsed, before torch is imported or a file is read; ``below`` words a value under 1. A value
    that is no integer at all is argparse's own usage error."""
    def parse(text: str) -> int:
        value = int(text)  # ValueError: argparse's "invalid int value"
        if value < 1:
            raise ConfigError(f"{flag}: got {value}; wanted {below}")
        return guards.check_int(value, flag, lo=1, hi=most)  # e.g. --tokens 1000000000 would die allocating

    parse.__name__ = "int"  # the name argparse gives the type in its own error
    return parse


def _add_runtime_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--platform", metavar="PLATFORM",
                   help="cpu, cuda:<major>.<minor>, rocm:<major>.<minor> or auto (this machine; the default), "
                        "e.g. --platform cuda:9.0")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="activation dtype (default: the model's torch_dtype, else bfloat16), e.g. --dtype float16")
    p.add_argument("--tp", type=_count("--tp", SIZE_MOST, POSITIVE), metavar="N",
                   help="tensor-parallel size (default 1), e.g. --tp 2")
    p.add_argument("--ep", type=_count("--ep", SIZE_MOST, POSITIVE), metavar="N",
                   help="expert-parallel size (default 1), e.g. --ep 8")
    p.add_argument("--dp", type=_count("--dp", SIZE_MOST, POSITIVE), metavar="N",
                   help="data-parallel size (default 1), e.g. --dp 2")
    runs = [b for b in ALL2ALL_BACKENDS if b in ALL2ALL_IMPLEMENTED]
    p.add_argument("--all2all", metavar="BACKEND",
                   help=f"all2all backend for EP dispatch: {', '.join(runs)} (default none: no dispatch; "
                        "allgather_reducescatter runs under torchrun); known, not implemented here: "
                        f"{', '.join(b for b in ALL2ALL_BACKENDS if b not in runs)}, "
                        "e.g. --ep 8 --all2all allgather_reducescatter")
    p.add_argument("--expert-placement", dest="expert_placement", metavar="HOW",
                   help=f"which rank owns which expert under --ep: {', '.join(EXPERT_PLACEMENTS)} (default contiguous: "
                        "rank r holds the r-th block; round_robin: expert e on rank e mod ep)")
    p.add_argument("--layer", type=int, metavar="N",
                   help="decoder layer (default: the first MoE layer), e.g. --layer 3")
    p.add_argument("--max-tokens", type=_count("--max-tokens", SIZE_MOST), dest="max_tokens", metavar="N",
                   help="token budget per forward, tested against kernels' token limits (default 8192), "
                        "e.g. --max-tokens 4096")
    _add_spec_dir(p)
    p.add_argument("--kernel", metavar="NAME",
                   help="pin this kernel: fail (exit 1) with the reasons if it cannot run, "
                        "e.g. --kernel torch-reference (names: moe-registry list kernels)")
    p.add_argument("--prefer", metavar="NAME",
                   help="prefer this kernel, falling back (and saying so) if it cannot run, "
                        "e.g. --prefer torch-reference")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="list every turned-down scheme (default: their count and the 3 nearest) "
                        "and, with --json, every passed check")


class _VersionAction(argparse.Action):
    """``--version``, reading the installed version only when asked (importlib.metadata is slow to import)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from moe_registry import __version__

        print(f"moe-registry {__version__}")
        parser.exit()


def build_parser() -> Parser:
    parser = Parser(prog="moe-registry", description="Declarative quantized-MoE kernel registry: which scheme and "
                    "kernel run a checkpoint here, and why.", formatter_class=argparse.RawDescriptionHelpFormatter,
                    epilog=_examples(f"moe-registry explain {EXAMPLE_CONFIG} --platform cuda:9.0",
                                     f"moe-registry run {EXAMPLE_MODEL} --layer 1",
                                     "moe-registry <command> --help"))
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    parser.subparsers_by_name = {}

    p = _add(parser, sub, "explain", "which scheme and kernel a model would use on a platform, and why",
             (f"moe-registry explain {EXAMPLE_CONFIG} --platform cuda:9.0",
              f"moe-registry explain {EXAMPLE_CONFIG} --platform cpu --json",
              "moe-registry explain runtime.yaml --kernel torch-reference --verbose"))
    p.add_argument("target", help="a config.json, a model dir (config.json inside) or a runtime YAML/JSON file")
    _add_runtime_flags(p)
    fmt = p.add_mutually_exclusive_group()
    _add_json(fmt, "the report")
    fmt.add_argument("--markdown", action="store_true", help="print the report as Markdown tables")
    p.set_defaults(func=cmd_explain)

    p = _add(parser, sub, "run", "load one MoE layer of a checkpoint, run it, compare with float64 and time it",
             (f"moe-registry run {EXAMPLE_MODEL} --layer 1",
              f"moe-registry run {EXAMPLE_MODEL} --tokens 64 --repeat 20 --threads 1 --json",
              f"moe-registry run {EXAMPLE_MODEL} --inputs in.safetensors --save-output out.safetensors",
              f"torchrun --nproc-per-node 2 -m moe_registry run {EXAMPLE_MODEL} --ep 2 --json   # expert parallel"))
    p.add_argument("target", help="a model dir (config.json and its safetensors)")
    _add_runtime_flags(p)
    p.add_argument("--tokens", type=_count("--tokens", guards.MAX_RUN_TOKENS), default=16, metavar="M",
                   help="random hidden states to run (default 16), e.g. --tokens 1 for decode")
    p.add_argument("--inputs", metavar="FILE",
                   help="safetensors file with hidden_states [M, hidden] (and optionally topk_ids and "
                        "topk_weights), e.g. --inputs in.safetensors")
    p.add_argument("--save-output", dest="save_output", metavar="FILE",
                   help="write the layer output to this safetensors file (its dir must exist), "
                        "e.g. --save-output out.safetensors")
    p.add_argument("--repeat", type=_count("--repeat", 100_000), metavar="N",
                   help="timed calls after a warm-up, >= 1 (default: as many as fit in about a second, 10 to 1000; "
                        "5 per rank under torchrun); the median, the middle half, min and max are reported, "
                        "e.g. --repeat 20")
    p.add_argument("--threads", type=_count("--threads", 4096), metavar="N",
                   help="CPU threads for torch (default: the CPUs this process may use); on a busy "
                        "machine --threads 1 gives steadier timings")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of the random inputs (default 0), e.g. --seed 1")
    _add_json(p, "the report and the result")
    p.set_defaults(func=cmd_run)

    p = _add(parser, sub, "list", "list the schemes, kernels or model families the registry knows",
             ("moe-registry list schemes", "moe-registry list kernel --json",
              "moe-registry list families --spec-dir my-specs/"))
    p.add_argument("what", type=_kind_word, choices=["scheme", "kernel", "family"], metavar="WHAT",
                   help="schemes, kernels or families (singular works too)")
    _add_json(p, "the list")
    _add_spec_dir(p)
    p.set_defaults(func=cmd_list)

    p = _add(parser, sub, "validate", "validate spec files: every problem, one line each with file:line",
             ("moe-registry validate", "moe-registry validate my-specs/", "moe-registry validate a.yaml b.yaml --json"))
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="spec files or spec dirs (default: the built-in specs), e.g. my-specs/schemes/x.yaml")
    _add_json(p, "the files read and the problems")
    p.set_defaults(func=cmd_validate)

    p = _add(parser, sub, "schema", "JSON Schema of the spec language, for editors",
             ("moe-registry schema > spec.schema.json   # any spec: oneOf scheme, kernel, family",
              "moe-registry schema scheme"))
    p.add_argument("kind", nargs="?", type=_kind_word, choices=["scheme", "kernel", "family"], metavar="KIND",
                   help="scheme, kernel or family (plural works too); without it, one schema whose oneOf "
                        "accepts any of the three")
    p.add_argument("--json", action="store_true", help="compact JSON (default: indented)")
    p.set_defaults(func=cmd_schema)

    p = _add(parser, sub, "matrix", "support matrix scheme x platform -> eligible kernels (docs/support-matrix.md)",
             ("moe-registry matrix > docs/support-matrix.md", "moe-registry matrix --json"))
    _add_json(p, "the matrix")
    _add_spec_dir(p)
    p.set_defaults(func=cmd_matrix)

    add_generate_parser(parser, sub, _add, _add_json)  # transformers is imported only when generate runs
    return parser


def _refused(err: SelectionError, args: argparse.Namespace) -> int:
    """A refusal prints the report that explains it, then the error."""
    verbose = getattr(args, "verbose", False)
    if _json_errors:
        extra = {"report": err.report.to_dict(verbose)} if err.report is not None else {}  # type: ignore[attr-defined]
        return emit_error(str(err), EXIT_REFUSED, extra)
    if err.report is not None:
        print_report(err.report, args)
    return emit_error(str(err), EXIT_REFUSED)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit code (see the module docstring)."""
    global _json_errors
    argv = sys.argv[1:] if argv is None else list(argv)
    _json_errors = "--json" in argv
    try:
        try:
            args = build_parser().parse_args(argv)  # a bad flag value is refused here (_count), before any import
            return int(args.func(args))
        except SelectionError as err:
            return _refused(err, args)
        except MoERegistryError as err:
            return emit_error(str(err), EXIT_BAD_INPUT)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        except BrokenPipeError:  # e.g. `moe-registry schema | head`
            sys.stderr.close()
            return EXIT_OK
        except Exception as err:  # a bug: one line, not a traceback (MOE_REGISTRY_DEBUG=1 shows it)
            if os.environ.get("MOE_REGISTRY_DEBUG"):
                raise
            msg = " ".join(str(err).split())[:300]
            return emit_error(f"internal error: {type(err).__name__}: {msg} (please report it; "
                              "MOE_REGISTRY_DEBUG=1 shows the traceback)", EXIT_INTERNAL, prefix="")
    finally:
        _json_errors = False


if __name__ == "__main__":
    sys.exit(main())
