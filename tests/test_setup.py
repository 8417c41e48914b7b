"""The two ways to install (pip via pyproject.toml, conda via environment.yml) agree."""

from __future__ import annotations

import re
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: pip vendors the same parser
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ]", req, maxsplit=1)[0].lower().replace("_", "-")


def _pyproject() -> dict[str, str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]  # make test installs both
    reqs = meta["dependencies"] + extras["dev"] + extras["hf"]
    return {_name(r): r.replace(" ", "") for r in reqs}


def _environment() -> dict[str, str]:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "- pip:")
    reqs = [line.strip()[2:].strip() for line in lines[start + 1:]
            if line.strip().startswith("- ")]
    return {_name(r): r.replace(" ", "") for r in reqs if not r.startswith("-e")}


def _constraints() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return {_name(x): x.strip() for x in lines if x.strip() and not x.startswith("#")}


def test_environment_yml_lists_the_pyproject_dependencies() -> None:
    pyproject, env = _pyproject(), _environment()
    assert set(env) == set(pyproject), (
        f"only in environment.yml: {sorted(set(env) - set(pyproject))}; "
        f"only in pyproject.toml: {sorted(set(pyproject) - set(env))}")
    pins = _constraints()
    for name, req in env.items():
        expected = pins.get(name, pyproject[name])
        assert req == expected, f"{name}: environment.yml has {req}, expected {expected}"


def test_torch_is_pinned_to_the_cpu_wheel() -> None:
    assert _constraints()["torch"] == "torch==2.13.0"
