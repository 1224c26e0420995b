"""The spec cache and the runtime view: a cached registry is the registry validation
builds, a stale or corrupt cache never changes an answer, and a cached start imports no pydantic or YAML."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_registry.spec import cache, models, view
from moe_registry.spec.loader import SPEC_PATH_ENV, load_registry
from moe_registry.spec.record import from_json, to_json
from moe_registry.spec.validation import build_registry

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples/mixtral-8x7b-awq/config.json"


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(d))
    monkeypatch.delenv(cache.NO_CACHE_ENV, raising=False)
    monkeypatch.delenv(SPEC_PATH_ENV, raising=False)
    return d


def _validated(*extra: Path) -> object:
    """The registry validation builds, the cache bypassed."""
    from moe_registry.spec.registry import builtin_spec_dir, spec_files

    root = builtin_spec_dir()
    sources = [(p, root) for p in spec_files(root)] + [(p, d) for d in extra for p in spec_files(d)]
    return build_registry(sources)


def _same(a: object, b: object) -> bool:
    return all(getattr(a, t) == getattr(b, t) for t in ("schemes", "kernels", "families", "formats"))


def _cache_files(d: Path) -> list[Path]:
    return sorted(d.glob("registry-*.json"))


def test_view_module_is_what_the_generator_writes():
    from gen_spec_view import render

    assert (ROOT / "moe_registry/spec/view.py").read_text() == render(), "run python tools/gen_spec_view.py"


def test_every_spec_model_has_a_view_with_its_fields():
    model_classes = {n: c for n, c in vars(models).items()
                     if isinstance(c, type) and issubclass(c, models.Strict) and c is not models.Strict}
    assert set(model_classes) == set(view.RECORDS)
    for name, cls in model_classes.items():
        assert tuple(cls.model_fields) == view.RECORDS[name].FIELDS, name


def test_a_cached_registry_is_the_validated_one(cache_dir: Path):
    first = load_registry()
    assert len(_cache_files(cache_dir)) == 1
    second = load_registry()
    assert _same(first, second) and _same(second, _validated())
    # the view keeps what the file wrote: `equals: null` is a test, an absent `equals` is not
    rule = second.scheme("compressed-tensors-w4a16").detect.fields["config_groups.group_0.input_activations"]
    assert rule.equals is None and rule.has_equals
    assert not second.scheme("compressed-tensors-w4a16").detect.fields["format"].has_equals


def test_a_cached_start_imports_neither_pydantic_nor_yaml(cache_dir: Path):
    probe = ("import sys; from moe_registry.cli.main import main; rc = main(sys.argv[1:]); "
             "print(sorted(m for m in ('pydantic', 'yaml', 'torch') if m in sys.modules))")
    env = {**os.environ, cache.CACHE_DIR_ENV: str(cache_dir)}
    argv = [sys.executable, "-c", probe, "explain", str(EXAMPLE), "--platform", "cuda:9.0"]
    cold = subprocess.run(argv, capture_output=True, text=True, env=env, check=True)
    warm = subprocess.run(argv, capture_output=True, text=True, env=env, check=True)
    assert cold.stdout.splitlines()[-1] == "['pydantic', 'yaml']"  # the first run validates
    assert warm.stdout.splitlines()[-1] == "[]"
    assert cold.stdout.splitlines()[:-1] == warm.stdout.splitlines()[:-1]  # the same answer


def _user_scheme(tmp_path: Path, group: int) -> Path:
    d = tmp_path / "user"
    (d / "schemes").mkdir(parents=True, exist_ok=True)
    text = (ROOT / "specs/schemes/awq-w4a16.yaml").read_text()
    text = text.replace("scheme: awq-w4a16", "scheme: my-awq")
    (d / "schemes/my-awq.yaml").write_text(text + f"\n# version {group}\n")
    return d


def test_a_changed_spec_file_is_another_key(cache_dir: Path, tmp_path: Path):
    user = _user_scheme(tmp_path, 1)
    before = load_registry([user])
    assert before.scheme("my-awq").summary.startswith("AutoAWQ")
    path = user / "schemes/my-awq.yaml"
    path.write_text(path.read_text().replace("summary: ", "summary: CHANGED ", 1))
    after = load_registry([user])
    assert after.scheme("my-awq").summary.startswith("CHANGED")
    path.unlink()  # a removed file: another key again
    assert "my-awq" not in load_registry([user]).schemes
    assert len(_cache_files(cache_dir)) == 3


def _corruptions(body: bytes) -> dict[str, bytes]:
    header, _, payload = body.partition(b"\n")
    meta = json.loads(header)
    forged_payload = payload.replace(b"AutoAWQ", b"EvilAWQ", 1)
    return {
        "truncated": body[: len(body) // 2],
        "empty": b"",
        "not json": b"\x00\xff garbage",
        "payload byte flipped": header + b"\n" + forged_payload,
        "another key": json.dumps({**meta, "key": "0" * 64}).encode() + b"\n" + payload,
        "another format": json.dumps({**meta, "format": 999}).encode() + b"\n" + payload,
        "valid digest, not an encoding": _rehash(meta, b'{"schemes": {"x": {"spec": {"$record": "Nope"}}}}'),
        "valid digest, a field missing": _rehash(meta, payload.replace(b'"summary":', b'"summaryX":', 1)),
        "valid digest, wrong table type": _rehash(meta, b'{"schemes": [], "kernels": {}, "families": {}, '
                                                        b'"formats": {}}'),
    }


def _rehash(meta: dict, payload: bytes) -> bytes:
    import hashlib

    return json.dumps({**meta, "sha256": hashlib.sha256(payload).hexdigest()}).encode() + b"\n" + payload


def test_a_corrupt_cache_never_changes_an_answer(cache_dir: Path):
    fresh = _validated()
    load_registry()
    (path,) = _cache_files(cache_dir)
    good = path.read_bytes()
    for what, body in _corruptions(good).items():
        path.write_bytes(body)
        assert _same(load_registry(), fresh), what
        assert path.read_bytes() == good, f"{what}: the cache file was not rewritten"


def test_no_cache_dir_or_an_unwritable_one_still_answers(cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path):
    monkeypatch.setenv(cache.NO_CACHE_ENV, "1")
    assert _same(load_registry(), _validated())
    assert not cache_dir.exists()
    monkeypatch.delenv(cache.NO_CACHE_ENV)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a dir")
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(blocker / "cache"))
    assert _same(load_registry(), _validated())


def test_a_registry_naming_user_code_is_not_cached(cache_dir: Path, tmp_path: Path):
    user = tmp_path / "user"
    (user / "kernels").mkdir(parents=True)
    (user / "mykernels").mkdir()
    (user / "mykernels/__init__.py").write_text("")
    kernel = (ROOT / "specs/kernels/torch-reference.yaml").read_text()
    kernel = kernel.replace("kernel: torch-reference", "kernel: my-ref")
    kernel = "\n".join("impl: mykernels:Experts" if line.startswith("impl:") else line for line in kernel.splitlines())
    (user / "kernels/my-ref.yaml").write_text(kernel + "\n")
    sys.path.insert(0, str(user))
    try:
        registry = load_registry([user])
    finally:
        sys.path.remove(str(user))
    assert "my-ref" in registry.kernels
    assert _cache_files(cache_dir) == []


def test_the_encoding_keeps_keys_a_spec_wrote_apart_from_its_own_tags():
    rule = view.FieldRule(equals={"$record": "SchemeSpec", "$dict": [1]}, one_of=None, range=None, present=None,
                          default=(1, "a"), aliases=[], case="sensitive", fields_set=frozenset({"equals"}))
    back = from_json(to_json(rule), view.RECORDS)
    assert back == rule and back.fields_set == {"equals"} and back.default == (1, "a")
    with pytest.raises(ValueError, match="not a spec"):
        from_json('{"$record": "FieldRule", "fields": {}}', view.RECORDS)


def test_a_write_that_fails_half_way_leaves_nothing_behind(cache_dir: Path, monkeypatch: pytest.MonkeyPatch):
    def refuse(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache.os, "replace", refuse)
    assert _same(load_registry(), _validated())
    assert list(cache_dir.iterdir()) == []
