"""The ways to install and run the project agree: pyproject.toml, constraints.txt, environment.yml,
the Makefile, the README and the CI script."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
NOT_PACKAGES = {"python", "pip"}


def normalize(name: str) -> str:
    """``Jupyter_Client`` -> ``jupyter-client`` (PEP 503 style)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(line: str) -> str:
    """The normalized name in ``torch==2.13.0``, ``ipyparallel>=9``, ``python=3.11`` or ``pkg[extra]``."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line)
    assert match, f"not a requirement: {line!r}"
    return normalize(match[1])


def pyproject_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(text) for text in project["dependencies"] + project["optional-dependencies"]["test"]]


def constraint_pins() -> dict[str, str]:
    """constraints.txt as {name: version}; fails on a line that is not ``name==version``."""
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, separator, version = line.partition("==")
        assert separator and version.strip(), f"constraints.txt: {line!r} is not pinned with =="
        assert normalize(name) not in pins, f"constraints.txt: {name} pinned twice"
        pins[normalize(name.strip())] = version.strip()
    return pins


def environment_pip_lines() -> list[str]:
    environment = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_sections = [item["pip"] for item in environment["dependencies"] if isinstance(item, dict)]
    assert len(pip_sections) == 1, "environment.yml needs exactly one pip: section"
    return [str(line).strip() for line in pip_sections[0]]


def environment_packages() -> dict[str, str | None]:
    """Packages environment.yml installs (conda and pip) as {name: pinned version or None}."""
    environment = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda_lines = [str(item) for item in environment["dependencies"] if not isinstance(item, dict)]
    packages: dict[str, str | None] = {}
    for line in conda_lines + environment_pip_lines():
        if line.startswith("-e "):
            continue
        name = requirement_name(line)
        if name in NOT_PACKAGES:
            continue
        assert name not in packages, f"environment.yml: {name} listed twice"
        pinned = re.fullmatch(r"[A-Za-z0-9._-]+==([^\s;,]+)", line)
        packages[name] = pinned[1] if pinned else None
    return packages


def test_environment_yml_installs_exactly_the_declared_dependencies_and_pins() -> None:
    declared = {normalize(requirement.name) for requirement in pyproject_requirements()}
    assert set(environment_packages()) == declared | set(constraint_pins())


def test_environment_yml_installs_this_project_editable() -> None:
    environment = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert environment["name"] == "ddp-magics"
    assert "conda-forge" in environment["channels"]
    assert "-e ." in environment_pip_lines()


def test_every_dependency_is_pinned_and_environment_yml_agrees() -> None:
    pins = constraint_pins()
    environment = environment_packages()
    for requirement in pyproject_requirements():
        name = normalize(requirement.name)
        assert name in pins, f"{name} is a dependency but constraints.txt does not pin it"
        assert requirement.specifier.contains(Version(pins[name]), prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject.toml's {requirement}"
        )
    for name, version in pins.items():
        assert environment[name] == version, (
            f"environment.yml has {name}=={environment[name]}, constraints.txt {name}=={version}"
        )


def test_torch_is_pinned_to_exactly_2_13_0() -> None:
    lines = [line.split("#", 1)[0].strip() for line in (ROOT / "constraints.txt").read_text().splitlines()]
    torch_lines = [line for line in lines if line and requirement_name(line) == "torch"]
    assert torch_lines == ["torch==2.13.0"]


def test_makefile_installs_only_through_constraints() -> None:
    makefile = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^(\w+)\s*:?=\s*(.*)$", makefile, re.MULTILINE))
    install_lines = [
        line for line in makefile.splitlines() if re.search(r"\bpip\)? install\b", line, re.IGNORECASE)
    ]
    assert install_lines, "the Makefile installs nothing with pip"
    for line in install_lines:
        expanded = re.sub(r"\$\((\w+)\)", lambda match: variables.get(match[1], match[0]), line)
        assert "-c constraints.txt" in expanded, f"Makefile installs without constraints: {line.strip()}"


@pytest.mark.parametrize("command", ["make lab", "make test"])
def test_readme_names_the_two_commands(command: str) -> None:
    assert command in (ROOT / "README.md").read_text()


def test_ci_runs_make_test() -> None:
    script = ROOT / ".ci" / "run"
    assert os.access(script, os.X_OK), ".ci/run is not executable"
    commands = [
        line.strip() for line in script.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]
    assert "set -euo pipefail" in commands
    assert "make test" in commands
